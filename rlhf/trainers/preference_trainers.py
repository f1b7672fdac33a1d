"""One step of preference optimisation: on pairs against a frozen reference policy, DPO/IPO/cDPO (`train_dpo`),
or without one, SimPO (`train_simpo`) and ORPO (`train_orpo`), all on one pair trainer; and KTO on labelled
single responses (`train_kto`). Sequence log-probs are sums over the response tokens (and EOS); the
reference's come from a `Frozen` role (colocated, or on its own ranks) in one phase per step, before the
policy's forward/backward passes. Every loss and metric is a sum over samples divided by the
count of the whole global batch, so DP ranks x micro-batches give the global mean whatever the split.

`rlhf.core.loop.Job`s; they know the model wrappers, the sampler and the batch records, not flags.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlhf.algorithms.preference_losses import (
    cpo_losses_B,
    dpo_losses_B,
    kto_losses_B,
    kto_reference_point,
    masked_sum_B,
    odds_ratio_losses_B,
    response_mask_BT1,
    simpo_losses_B,
)
from rlhf.core.accumulate import MicroLoss, global_counts, optimizer_step, step_metrics
from rlhf.core.metrics import Reduce
from rlhf.data.supervised_samples import PairBatch, SFTBatch, UnpairedBatch, mismatched
from rlhf.distributed.topology import Role
from rlhf.models.lm_logprobs import policy_forward
from rlhf.trainers.frozen import Frozen
from rlhf.trainers.supervised_trainer import MODEL, SupervisedTrainer

REFERENCE = Role.REF

KTO_METRICS = {**dict.fromkeys(("kto_loss", "chosen_reward", "reject_reward"), Reduce.SHARE),
               **dict.fromkeys(("kl", "grad_norm", "lr", "nonfinite_skipped"), Reduce.LEAD)}


class PreferenceTrainer(SupervisedTrainer):
    """What the preference trainers share: the reference's (if any) and the policy's sequence log-probs of a
    micro-batch."""

    def __init__(self, *args, reference: Frozen | None) -> None:
        super().__init__(*args)
        self.reference = reference

    def reference_logps(self, micro_batches: list) -> list[torch.Tensor]:
        """The reference's response log-prob sums [B'] of each micro-batch, in one phase."""
        self.reference.begin(len(micro_batches))
        out = []
        for batch in micro_batches:
            ids, mask, loss_mask = self.tokens(batch)
            out.append(masked_sum_B(self.reference.request(ids, mask)[:, :-1], loss_mask.to(self.device)))
        self.reference.end()
        return out

    def policy_logps(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(response log-prob sums [B'], response token counts [B']) under the trained policy."""
        ids, mask, loss_mask = self.tokens(batch)
        logprobs_BT1 = policy_forward(self.model.engine, ids.to(self.device), mask.to(self.device),
                                      layout=self.batcher.layout).logprobs_BT1
        loss_mask = loss_mask.to(self.device)
        return masked_sum_B(logprobs_BT1, loss_mask), loss_mask.sum(-1)

    def tokens(self, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids [B', T], attention mask [B', T], response mask [B', T1]) of one forward."""
        return batch.input_ids_BT, batch.attention_mask_BT, batch.loss_mask_BT1


@dataclass
class PairTerms:
    """One micro-batch of B pairs: `objective_B` is minimised; `chosen_B`/`rejected_B` are the implicit rewards
    (detached; accuracy is chosen > rejected); `logged_B` are per-pair terms logged as their mean over the
    global batch ("loss": the preference loss)."""

    objective_B: torch.Tensor
    chosen_B: torch.Tensor
    rejected_B: torch.Tensor
    logged_B: dict[str, torch.Tensor]


def pair_metrics(*terms: str) -> dict[str, Reduce]:
    """The metric table of a pair trainer that logs `terms` besides the shared ones."""
    return {**dict.fromkeys(("loss", "acc", "chosen_reward", "reject_reward", "margin", *terms), Reduce.SHARE),
            **dict.fromkeys(("grad_norm", "lr", "nonfinite_skipped"), Reduce.LEAD)}


DPO_METRICS = pair_metrics("nll_loss")
SIMPO_METRICS = pair_metrics()
ORPO_METRICS = pair_metrics("nll_loss", "or_loss", "log_odds_ratio")
CPO_METRICS = pair_metrics("nll_loss")


class PairTrainer(PreferenceTrainer):
    """A loss on preference pairs on the ranks of `MODEL`, with a frozen reference or without one
    (`reference` None): each micro-batch's chosen and rejected sequences in one forward (packed together with
    --packing_samples). A subclass gives `pair_terms`; the step and the held-out evaluation are shared."""

    batch_type = PairBatch
    eval_sums = (6,)

    def __init__(self, *args, reference: Frozen | None = None) -> None:
        super().__init__(*args, reference=reference)

    def cost_mask(self, batch: PairBatch) -> torch.Tensor:
        return torch.cat([batch.chosen_mask_BT, batch.rejected_mask_BT], dim=1)  # both halves are run

    def tokens(self, batch: PairBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ids, mask = batch.concatenated()
        return ids, mask, response_mask_BT1(mask, torch.cat([batch.prompt_lens_B, batch.prompt_lens_B]))

    def pair_terms(self, batch: PairBatch, ref_2B: torch.Tensor | None) -> PairTerms:
        """The loss terms of one micro-batch (`ref_2B`: the reference's chosen then rejected sequence
        log-probs, None without a reference)."""
        raise NotImplementedError

    def _reference(self, micro_batches: list) -> list:
        return self.reference_logps(micro_batches) if self.reference is not None else [None] * len(micro_batches)

    def step(self, step: int) -> dict[str, float]:
        with self.timer.stage("train"):
            micro_batches = self.next_micro_batches(step)
            (num_pairs,) = global_counts([sum(m.num_samples for m in micro_batches)], self.group,
                                         self.batcher.layout.ring_size)
            refs = self._reference(micro_batches)

            def micro_loss(item: tuple[PairBatch, torch.Tensor | None]) -> MicroLoss:
                t = self.pair_terms(*item)
                terms = {name: v.sum() / num_pairs for name, v in t.logged_B.items()}
                terms.update({"acc": (t.chosen_B > t.rejected_B).float().sum() / num_pairs,
                              "chosen_reward": t.chosen_B.sum() / num_pairs,
                              "reject_reward": t.rejected_B.sum() / num_pairs,
                              "margin": (t.chosen_B - t.rejected_B).sum() / num_pairs})
                return MicroLoss(t.objective_B.sum() / num_pairs, terms)

            stats = step_metrics(self.model, optimizer_step(self.model, list(zip(micro_batches, refs)), micro_loss))
        return self.reduced(stats)

    def eval_batches(self) -> tuple[list, int]:
        batches, counted = self.eval_micro_batches()
        return list(zip(batches, self._reference(batches))), counted

    def eval_scores(self, items: list):
        """Pairs, loss sum, correct pairs, margin sum, chosen and rejected reward sums of each micro-batch."""
        for batch, ref in items:
            t = self.pair_terms(batch, ref)
            yield (batch.num_samples, t.logged_B["loss"].sum(), (t.chosen_B > t.rejected_B).sum(),
                   (t.chosen_B - t.rejected_B).sum(), t.chosen_B.sum(), t.rejected_B.sum())

    def eval_metrics(self, totals: list[float]) -> dict[str, float]:
        """Held-out loss, accuracy (chosen reward > rejected reward), margin and mean rewards."""
        pairs, loss, correct, margin, chosen, rejected = totals
        pairs = max(pairs, 1.0)
        return {"eval_loss": loss / pairs, "eval_acc": correct / pairs, "eval_margin": margin / pairs,
                "eval_chosen_reward": chosen / pairs, "eval_reject_reward": rejected / pairs}


class DPOTrainer(PairTrainer):
    """DPO (sigmoid), IPO or cDPO against the frozen reference, plus `nll_loss_coef` x the chosen responses'
    per-token NLL (OpenRLHF: each pair's token mean, averaged over pairs)."""

    metrics = DPO_METRICS

    def __init__(self, *args, reference: Frozen, beta: float, label_smoothing: float, ipo: bool,
                 nll_loss_coef: float) -> None:
        super().__init__(*args, reference=reference)
        self.beta, self.label_smoothing, self.ipo, self.nll_loss_coef = beta, label_smoothing, ipo, nll_loss_coef

    def pair_terms(self, batch: PairBatch, ref_2B: torch.Tensor | None) -> PairTerms:
        B = batch.num_samples
        logps_2B, counts_2B = self.policy_logps(batch)
        loss_B, chosen_B, rejected_B = dpo_losses_B(logps_2B[:B], logps_2B[B:], ref_2B[:B], ref_2B[B:],
                                                    beta=self.beta, label_smoothing=self.label_smoothing,
                                                    ipo=self.ipo)
        if self.nll_loss_coef <= 0:
            return PairTerms(loss_B, chosen_B, rejected_B, {"loss": loss_B})
        nll_B = -logps_2B[:B] / counts_2B[:B].clamp(min=1)
        return PairTerms(loss_B + self.nll_loss_coef * nll_B, chosen_B, rejected_B,
                         {"loss": loss_B, "nll_loss": nll_B})


class SimPOTrainer(PairTrainer):
    """SimPO (reference-free): the length-normalised log-likelihood margin against a target margin."""

    metrics = SIMPO_METRICS

    def __init__(self, *args, beta: float, gamma: float) -> None:
        super().__init__(*args)
        self.beta, self.gamma = beta, gamma

    def pair_terms(self, batch: PairBatch, ref_2B: None) -> PairTerms:
        B = batch.num_samples
        logps_2B, counts_2B = self.policy_logps(batch)
        avg_2B = logps_2B / counts_2B.clamp(min=1)
        loss_B, chosen_B, rejected_B = simpo_losses_B(avg_2B[:B], avg_2B[B:], beta=self.beta, gamma=self.gamma)
        return PairTerms(loss_B, chosen_B, rejected_B, {"loss": loss_B})


class ORPOTrainer(PairTrainer):
    """ORPO (reference-free): the chosen responses' per-token NLL (each pair's token mean, averaged over pairs)
    plus `orpo_lambda` x the odds-ratio loss. Implicit rewards: lambda x the average log-prob (as TRL logs)."""

    metrics = ORPO_METRICS

    def __init__(self, *args, orpo_lambda: float) -> None:
        super().__init__(*args)
        self.orpo_lambda = orpo_lambda

    def pair_terms(self, batch: PairBatch, ref_2B: None) -> PairTerms:
        B = batch.num_samples
        logps_2B, counts_2B = self.policy_logps(batch)
        avg_2B = logps_2B / counts_2B.clamp(min=1)
        or_loss_B, log_odds_B = odds_ratio_losses_B(avg_2B[:B], avg_2B[B:])
        nll_B = -avg_2B[:B]
        loss_B = nll_B + self.orpo_lambda * or_loss_B
        rewards_2B = self.orpo_lambda * avg_2B.detach()
        return PairTerms(loss_B, rewards_2B[:B], rewards_2B[B:],
                         {"loss": loss_B, "nll_loss": nll_B, "or_loss": or_loss_B, "log_odds_ratio": log_odds_B})


class CPOTrainer(PairTrainer):
    """CPO (reference-free): the preference term -log sigmoid(beta (chosen - rejected sequence log-prob)) plus
    `cpo_alpha` x the chosen responses' per-token NLL (each pair's token mean, averaged over pairs, as ORPO's)."""

    metrics = CPO_METRICS

    def __init__(self, *args, beta: float, cpo_alpha: float) -> None:
        super().__init__(*args)
        self.beta, self.cpo_alpha = beta, cpo_alpha

    def pair_terms(self, batch: PairBatch, ref_2B: None) -> PairTerms:
        B = batch.num_samples
        logps_2B, counts_2B = self.policy_logps(batch)
        loss_B, chosen_B, rejected_B = cpo_losses_B(logps_2B[:B], logps_2B[B:], beta=self.beta)
        nll_B = -logps_2B[:B] / counts_2B[:B].clamp(min=1)
        return PairTerms(loss_B + self.cpo_alpha * nll_B, chosen_B, rejected_B, {"loss": loss_B, "nll_loss": nll_B})


class KTOTrainer(PreferenceTrainer):
    """KTO on the ranks of `MODEL`. The reference point z0 of a step is the mean policy - reference
    log-prob of mismatched pairs (each sample's prompt with the next sample's response, over this rank's
    samples of the step), averaged over the data-parallel group and clamped at 0, as the KTO paper and
    OpenRLHF's `KTOLoss` (there per micro-batch; here per optimizer step, so it does not depend on the
    micro-batch size)."""

    batch_type = UnpairedBatch
    metrics = KTO_METRICS
    eval_sums = (2, 8)  # the held-out reference point's sums, then the scores'

    def __init__(self, *args, reference: Frozen, beta: float, desirable_weight: float, undesirable_weight: float,
                 max_len: int) -> None:
        super().__init__(*args, reference=reference)
        self.beta, self.desirable_weight, self.undesirable_weight = beta, desirable_weight, undesirable_weight
        self.max_len = max_len

    def _kl_samples(self, samples: list) -> list:
        n = len(samples)
        return [mismatched(samples[i], samples[(i + 1) % n], self.tokenizer.eos_token_id, self.max_len)
                for i in range(n)]

    def _reference_point(self, kl_batches: list[SFTBatch], kl_refs: list[torch.Tensor], counted: int,
                         world: bool) -> torch.Tensor:
        """z0 from the first `counted` of this rank's mismatched-pair micro-batches, summed over the model's
        group (or, with `world`, over the world, as the evaluation's sums)."""
        total, count = 0.0, 0.0
        with torch.no_grad():
            for b, (batch, ref) in enumerate(zip(kl_batches, kl_refs)):
                logps, _ = self.policy_logps(batch)
                if b < counted:
                    total += float((logps - ref).sum())
                    count += batch.num_samples
        if world:
            kl_sum, kl_count = self.world_sums([total, count])
        else:
            t = torch.tensor([total, count], dtype=torch.float64)
            dist.all_reduce(t, group=self.group)
            kl_sum, kl_count = (t / self.batcher.layout.ring_size).tolist()
        return kto_reference_point(kl_sum, kl_count)

    def _phase(self, samples: list, evaluation: bool):
        """(matched micro-batches, how many count, their reference log-probs, z0): the reference answers for
        the mismatched pairs and the samples in one phase, then the reference point."""
        if evaluation:  # fixed-size micro-batches, padded to the same count on every rank
            batches, counted = self.eval_micro_batches(samples)
            kl_batches, kl_counted = self.eval_micro_batches(self._kl_samples(samples), SFTBatch,
                                                             fallback=self._kl_samples(self.eval_samples[:1]))
        else:
            batches = self.micro_batches(samples)
            kl_batches = self.micro_batches(self._kl_samples(samples), batch_type=SFTBatch)
            counted, kl_counted = len(batches), len(kl_batches)
        refs = self.reference_logps(kl_batches + batches)
        z0 = self._reference_point(kl_batches, refs[:len(kl_batches)], kl_counted, evaluation)
        return batches, counted, refs[len(kl_batches):], z0

    def _terms(self, batch: UnpairedBatch, ref_B: torch.Tensor, z0: torch.Tensor):
        logps_B, _ = self.policy_logps(batch)
        return kto_losses_B(logps_B, ref_B, batch.desirable_B, z0, beta=self.beta,
                            desirable_weight=self.desirable_weight, undesirable_weight=self.undesirable_weight)

    def step(self, step: int) -> dict[str, float]:
        assert self.sampler.step == step, f"sampler at step {self.sampler.step}, loop at {step}"
        with self.timer.stage("train"):
            samples = [self.samples[i] for i in self.sampler.next()]
            desirable = sum(s.desirable for s in samples)
            n, n_desirable, n_undesirable = global_counts([len(samples), desirable, len(samples) - desirable],
                                                          self.group, self.batcher.layout.ring_size)
            batches, _, refs, z0 = self._phase(samples, evaluation=False)

            def micro_loss(item: tuple[UnpairedBatch, torch.Tensor]) -> MicroLoss:
                batch, ref = item
                loss_B, reward_B = self._terms(batch, ref, z0)
                d = batch.desirable_B.to(reward_B.device)
                loss = loss_B.sum() / n
                return MicroLoss(loss, {"kto_loss": loss,
                                        "chosen_reward": torch.where(d, reward_B, 0.0).sum() / n_desirable,
                                        "reject_reward": torch.where(d, 0.0, reward_B).sum() / n_undesirable})

            stats = step_metrics(self.model, optimizer_step(self.model, list(zip(batches, refs)), micro_loss))
        if "nonfinite_skipped" not in stats or stats["nonfinite_skipped"] == 0:
            stats["kl"] = float(z0)
        return self.reduced(stats)

    def _eval_share(self) -> list:
        """This replica's held-out samples, dealt in turn; both samples of a preference pair go to the same
        replica."""
        dp, rank = self.topology.dp_size(MODEL), self.topology.dp_rank(MODEL)
        units: list[list] = []  # a pair or a single sample
        for s in self.eval_samples:
            if s.pair is not None and units and units[-1][0].pair == s.pair:
                units[-1].append(s)
            else:
                units.append([s])
        return [s for unit in units[rank::dp] for s in unit]

    def eval_batches(self) -> tuple[list, int]:
        batches, counted, refs, self._eval_z0 = self._phase(self._eval_share(), evaluation=True)
        return list(zip(batches, refs)), counted

    def eval_scores(self, items: list):
        """Samples, loss sum, desirable samples and their reward sum, undesirable ones and theirs, and the
        preference pairs completed by the micro-batch (a pair may straddle micro-batches) with how many of
        them rank the chosen response's reward above the rejected one's."""
        halves: dict[int, dict[bool, float]] = {}  # pair -> desirable? -> reward
        for batch, ref in items:
            loss_B, reward_B = self._terms(batch, ref, self._eval_z0)
            d = batch.desirable_B.to(reward_B.device)
            pairs = correct = 0
            for pair, good, r in zip(batch.pair_B.tolist(), d.tolist(), reward_B.tolist()):
                if pair >= 0:
                    halves.setdefault(pair, {})[good] = r
                    if len(halves[pair]) == 2:
                        pairs, correct = pairs + 1, correct + (halves[pair][True] > halves[pair][False])
            yield (batch.num_samples, loss_B.sum(), d.sum(), torch.where(d, reward_B, 0.0).sum(), (~d).sum(),
                   torch.where(d, 0.0, reward_B).sum(), pairs, correct)

    def eval_metrics(self, totals: list[float]) -> dict[str, float]:
        """Held-out KTO loss (with the held-out reference point), mean rewards of desirable and undesirable
        samples, and, for samples that came from preference pairs, the pair accuracy."""
        n, loss, n_d, r_d, n_u, r_u, pairs, correct = totals
        out = {"eval_loss": loss / max(n, 1.0), "eval_kl": float(self._eval_z0),
               "eval_chosen_reward": r_d / max(n_d, 1.0), "eval_reject_reward": r_u / max(n_u, 1.0)}
        if pairs:
            out["eval_acc"] = correct / pairs
        return out
