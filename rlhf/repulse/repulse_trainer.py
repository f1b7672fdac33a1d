"""RePULSe's step on PPO's engines (README.md, RePULSe section): K samples per prompt from the
policy p and from the proposal q, q's CTL update toward sigma ∝ p·exp(beta·r), then p's update (REINFORCE
with the leave-one-out baseline, plus alpha x the SNIS-weighted log-likelihood of q's samples, pushed down).

The rollout engine holds p's weights between steps; within a step q's weights are pushed in to sample q and
p's are pushed back after the update (one engine, weights swapped: see README "RePULSe"). q lives on the
actor's ranks, or on ranks of its own (--proposal_num_gpus_per_node), where its update runs beside p's.
The baselines are switches of the same step: `--harmlessness_training_loss_type reinforce` (no q),
`--use_base_as_proposal` (p's own samples are the negatives), `--reward_transform`.
Per-role math lives in `rlhf.repulse.repulse_losses`; this module only orders the stages and splits the
samples into optimizer steps and micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from rlhf.core.accumulate import MicroLoss, optimizer_step, step_metrics
from rlhf.core.metrics import Reduce, add_update, per_update_means, reduce_metrics
from rlhf.core.state import CheckpointedState
from rlhf.data.records import Rollout, TokenBatch
from rlhf.distributed.collectives import all_gather_rollout, assemble, shard
from rlhf.distributed.topology import Role
from rlhf.models.lm_logprobs import policy_forward
from rlhf.repulse import repulse_losses
from rlhf.repulse.repulse_config import TrainRepulseConfig
from rlhf.trainers.actor import Actor
from rlhf.trainers.ppo_trainer import PPOTrainer

REPULSE_METRICS = {
    **dict.fromkeys(("ctl_loss", "dpg_loss", "policy_loss", "neg_term"), Reduce.SHARE),
    **dict.fromkeys(("grad_norm", "lr", "q_grad_norm", "q_lr", "nonfinite_skipped", "q_nonfinite_skipped"),
                    Reduce.LEAD),
}


@dataclass
class GroupSamples(TokenBatch):
    """One kind of samples of the step, a prompt's K samples contiguous (global batch, same on every rank).

    weights_B: float32 [B] the per-sample coefficient of the policy's loss (p-samples: the advantage R - b;
    negatives: the SNIS weight w). logq_old_BT1 / logp_BT1: float32 [B, T-1] q at sampling time and p, on q's
    samples (zeros where unused). beta_r_B: float32 [B] beta x reward. ctl_pi_BT1: float32 [B, T-1] CTL's
    per-position weights, set only for a step whose groups are split (`RepulseTrainer._with_ctl_pi`).
    """

    sequences_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    action_mask_BT1: torch.Tensor
    weights_B: torch.Tensor
    logq_old_BT1: torch.Tensor
    logp_BT1: torch.Tensor
    beta_r_B: torch.Tensor
    ctl_pi_BT1: torch.Tensor | None = None


PROPOSAL = Role.define("proposal")
"""RePULSe's q: a second trainable copy of the policy, on the actor's ranks or ranks of its own."""


class RepulseTrainer(PPOTrainer):
    """One RePULSe step (a `rlhf.core.loop.Job`); construct on every rank with the same config, PPO's trainer's
    arguments and `proposal` (q's actor; None where this rank does not host q)."""

    def __init__(self, cfg: TrainRepulseConfig, *args, proposal: Actor | None, **kwargs) -> None:
        super().__init__(cfg, *args, **kwargs)
        self.rp = cfg.repulse
        self.k = cfg.schedule.samples_per_prompt
        self.proposal = proposal
        self.has_proposal = PROPOSAL in self.topology.plan  # whether the run has a q at all
        self.trainable = self.roles.trainable + ([proposal.model] if proposal is not None else [])

    # ---- checkpoint -----------------------------------------------------------------------------------

    def checkpointed(self) -> CheckpointedState:
        state = super().checkpointed()
        state.engines["proposal"] = self.proposal.model if self.proposal is not None else None
        return state

    # ---- the step -----------------------------------------------------------------------------------

    def step(self, step: int) -> dict[str, float]:
        self.steps_done = step + 1
        e = self.cfg.engine
        with self.timer.stage("generation"):
            p_local = self.generate(step)
            q_locals = []
            if self.has_proposal:  # q's weights into the engine, then back to p's after the update
                self.push_weights(PROPOSAL, self.proposal)
                q_locals = [self.generate(step, stream=1 + i) for i in range(self.cfg.batch.num_episodes)]
            self.engine.sleep()
        pad = self.tokenizer.pad_token_id
        with self.timer.stage("experience"):
            self._move(self.roles.frozen, to_host=False, enabled=e.ref_reward_offload)
            positives, metrics = self._policy_samples(all_gather_rollout(p_local, pad), step)
            q_batches = [all_gather_rollout(q, pad) for q in q_locals]
            self._move(self.roles.frozen, to_host=True, enabled=e.ref_reward_offload)
        self.records.samples_drawn += positives.num_samples * (1 + len(q_batches))
        with self.timer.stage("train"):
            self._move(self.trainable, to_host=False, enabled=e.deepspeed_enable_sleep and step > 0)
            stats: dict[str, float] = {}
            q_stats: dict[str, float] = {}
            negatives = None
            for q_batch in q_batches:  # --num_episodes q updates, each on its own batch (drawn before them)
                negatives, q_metrics = self._proposal_samples(q_batch, step)
                if self.proposal is not None:
                    add_update(q_stats, self._train_proposal(negatives, step))
            if self.rp.use_base_as_proposal:
                negatives = self._base_negatives(positives)
            if self.roles.actor is not None:  # p's negatives are q's samples drawn before q's updates
                add_update(stats, self._train_policy(positives, negatives, step))
            self._move(self.trainable, to_host=True, enabled=e.deepspeed_enable_sleep)
        if q_batches:
            metrics.update(q_metrics)
        metrics.update(reduce_metrics({Role.ACTOR: per_update_means(stats), PROPOSAL: per_update_means(q_stats)},
                                      REPULSE_METRICS, self.topology))
        metrics["samples_drawn"] = float(self.samples_drawn)
        with self.timer.stage("weight_sync"):
            self.engine.wake_up()
            self.sync_weights()  # p's weights back (the engine held q's, or slept)
        return metrics

    # ---- experience -----------------------------------------------------------------------------------

    def _policy_samples(self, batch: Rollout, step: int) -> tuple[GroupSamples, dict[str, float]]:
        """p's samples: rewards, the optional transform, k1 KL to the reference, returns and advantages."""
        exp, rp = self.roles.experience, self.rp
        raw, old, ref = exp.score(batch, with_ref=self.cfg.algo.needs_ref, rm_max_len=self.rm_max_len)
        self.records.keep_negatives(batch, raw, "policy", step)
        rewards = raw
        if rp.reward_transform is not None:
            transform = repulse_losses.REWARD_TRANSFORMS[rp.reward_transform]
            rewards = transform(raw, rp.transform_alpha, rp.transform_beta, rp.threshold)
        action = batch.action_mask_BT1
        kl_coef = self.cfg.algo.init_kl_coef
        if ref is not None:
            returns, kl = repulse_losses.policy_returns_PK(rewards, old, ref, action, kl_coef)
        else:
            returns, kl = rewards.float(), torch.zeros_like(rewards)
        returns_PK = returns.reshape(-1, self.k)
        advantages = (returns_PK - repulse_losses.rloo_baseline_PK(returns_PK)).reshape(-1)
        zeros = torch.zeros_like(old)
        beta = rp.target_dist_beta if rp.target_dist_beta is not None else 0.0  # None: no negatives use it
        samples = GroupSamples(batch.sequences_BT, batch.attention_mask_BT, action, advantages, zeros, old,
                               beta * raw.float())
        metrics = {"reward_mean": float(raw.mean()), "reward_shaped_mean": float(rewards.mean()),
                   "return_mean": float(returns.mean()), "kl": float(kl.mean()),
                   "response_length": float(batch.response_lens_B.float().mean())}
        return samples, metrics

    def _proposal_samples(self, batch: Rollout, step: int) -> tuple[GroupSamples, dict[str, float]]:
        """q's samples: beta·r, log q at sampling time, log p, and the SNIS weights toward sigma."""
        exp = self.roles.experience
        raw, logp, _ = exp.score(batch, with_ref=False, rm_max_len=self.rm_max_len)
        self.records.keep_negatives(batch, raw, "proposal", step)
        B, T = batch.sequences_BT.shape
        seq, mask = batch.sequences_BT, batch.attention_mask_BT
        logq = exp.gather(PROPOSAL, lambda w: self.proposal.logprobs(seq[w], mask[w]), (B, T - 1))
        action = batch.action_mask_BT1
        beta_r = self.rp.target_dist_beta * raw.float()
        weights = repulse_losses.snis_weights_PK(repulse_losses.masked_sum_PK(logp, action).reshape(-1, self.k),
                                                 beta_r.reshape(-1, self.k),
                                                 repulse_losses.masked_sum_PK(logq, action).reshape(-1, self.k))
        samples = GroupSamples(seq, mask, action, weights.reshape(-1), logq, logp, beta_r)
        ess = 1.0 / float((weights ** 2).sum(-1).mean())  # effective sample size of a group's weights
        return samples, {"q_reward_mean": float(raw.mean()), "q_weights_ess": ess}

    def _base_negatives(self, positives: GroupSamples) -> GroupSamples:
        """--use_base_as_proposal: p's samples weighted by softmax over the group of beta·r."""
        weights = repulse_losses.base_as_proposal_weights_PK(positives.beta_r_B.reshape(-1, self.k)).reshape(-1)
        return GroupSamples(positives.sequences_BT, positives.attention_mask_BT, positives.action_mask_BT1, weights,
                            positives.logp_BT1, positives.logp_BT1, positives.beta_r_B)

    # ---- updates --------------------------------------------------------------------------------------

    def _step_rows(self, total: int, role: Role) -> list[list[slice]]:
        """The global rows of this replica's (of `role`) micro-batches, per optimizer step: step j takes rows
        [j·S, (j+1)·S) of the global batch (S = --train_batch_size), split evenly over the role's replicas, each
        share cut into micro-batches of --micro_train_batch_size. A prompt's group may span micro-batches and
        replicas: its advantages and weights were computed on the whole group before the split."""
        b = self.cfg.batch
        dp, rank = self.topology.dp_size(role), self.topology.dp_rank(role)
        steps = []
        for start in range(0, total, b.train_batch_size):
            share = shard(min(b.train_batch_size, total - start), dp, rank)
            lo, hi = start + share.start, start + share.stop
            steps.append([slice(m, min(m + b.micro_train_batch_size, hi))
                          for m in range(lo, hi, b.micro_train_batch_size)])
        return steps

    def _group_steps(self, samples: GroupSamples, role: Role) -> list[list[GroupSamples]]:
        """This replica's micro-batches of `samples`, per optimizer step (`_step_rows`)."""
        return [[samples.select(rows).trimmed() for rows in micros]
                for micros in self._step_rows(samples.num_samples, role)]

    def _whole_groups(self, micros: list[slice]) -> bool:
        """Whether each micro-batch holds whole groups. The same answer on every replica (so all or none run
        `_with_ctl_pi`'s collectives): the replicas' rows are rank 0's shifted by the share S/dp, and when S/dp
        is not a multiple of K rank 0's last row and the others' first rows are off a group boundary."""
        return all(rows.start % self.k == 0 and rows.stop % self.k == 0 for rows in micros)

    def _with_ctl_pi(self, samples: GroupSamples, micros: list[slice]) -> list[GroupSamples]:
        """This replica's micro-batches of a CTL step whose groups are split over micro-batches or replicas,
        each with its rows of w_pi: the step's samples are scored by the current q (no gradient, each replica
        its own share, gathered over q's ranks), so every group is whole when its weights are computed. The
        step holds whole groups (--train_batch_size is a multiple of K: checked with the flags)."""
        b = self.cfg.batch
        start = micros[0].start // b.train_batch_size * b.train_batch_size
        size = min(b.train_batch_size, samples.num_samples - start)
        step = samples.select(slice(start, start + size))
        mine = slice(micros[0].start - start, micros[-1].stop - start)
        with torch.no_grad():
            part = self.proposal.logprobs(step.sequences_BT[mine], step.attention_mask_BT[mine])
        logq = assemble(part, mine, tuple(step.logp_BT1.shape), self.topology.group(PROPOSAL))
        shape = (size // self.k, self.k, -1)
        pi = repulse_losses.ctl_pi_weights_PKT1(logq.reshape(shape), step.logp_BT1.reshape(shape),
                                                step.logq_old_BT1.reshape(shape),
                                                step.action_mask_BT1.reshape(shape)).reshape(size, -1)
        step = replace(step, ctl_pi_BT1=pi)
        return [step.select(slice(rows.start - start, rows.stop - start)).trimmed() for rows in micros]

    def _mean_logprobs(self, model: Actor, micro: GroupSamples) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-token log-probs [B, T-1] with gradients, the response mask) of a micro-batch under `model`."""
        dev = self.device
        out = policy_forward(model.model.engine, micro.sequences_BT.to(dev), micro.attention_mask_BT.to(dev),
                             model.temperature, layout=model.layout)
        return out.logprobs_BT1, micro.action_mask_BT1.to(dev)

    def _train_proposal(self, samples: GroupSamples, step: int) -> dict[str, float]:
        """CTL (or DPG): one optimizer step per --train_batch_size q samples; the loss of a micro-batch is its
        share of minus the mean over the step's samples of the per-sample terms. CTL's per-position weights come
        from the micro-batch's own forward when it holds whole groups, else from `_with_ctl_pi`."""
        total = float(self.cfg.batch.train_batch_size)
        q, dev, kind = self.proposal, self.device, self.rp.actor_loss_type
        terms = repulse_losses.PROPOSAL_TERMS[kind]

        def micro_loss(micro: GroupSamples) -> MicroLoss:
            logq, mask = self._mean_logprobs(q, micro)
            logp, w_pi = micro.logp_BT1.to(dev), None
            if kind == "ctl":
                if micro.ctl_pi_BT1 is not None:
                    w_pi = micro.ctl_pi_BT1.to(dev)
                else:
                    shape = (micro.num_samples // self.k, self.k, -1)
                    w_pi = repulse_losses.ctl_pi_weights_PKT1(
                        logq.reshape(shape), logp.reshape(shape), micro.logq_old_BT1.to(dev).reshape(shape),
                        mask.reshape(shape)).reshape(micro.num_samples, -1)
            share = -terms(logq, logp, mask, micro.weights_B.to(dev), w_pi).sum() / total
            return MicroLoss(share, {f"{kind}_loss": share})

        stats: dict[str, float] = {}
        for rows in self._step_rows(samples.num_samples, PROPOSAL):
            if kind == "ctl" and not self._whole_groups(rows):
                micros = self._with_ctl_pi(samples, rows)
            else:
                micros = [samples.select(r).trimmed() for r in rows]
            add_update(stats, step_metrics(q.model, optimizer_step(q.model, micros, micro_loss), prefix="q_"))
        out = per_update_means(stats)
        if "lr" in out:
            out["q_lr"] = out.pop("lr")
        return out

    def _train_policy(self, positives: GroupSamples, negatives: GroupSamples | None, step: int) -> dict[str, float]:
        """REINFORCE on p's samples (+ alpha x the weighted negatives with neg_training), one optimizer step
        per --train_batch_size p samples; each p step takes the negatives of the same prompts."""
        total = float(self.cfg.batch.train_batch_size)
        actor, alpha = self.roles.actor, self.rp.alpha
        with_negatives = negatives is not None and self.rp.harmlessness_training_loss_type == "neg_training"

        def micro_loss(item: tuple[str, GroupSamples]) -> MicroLoss:
            kind, micro = item
            logp, mask = self._mean_logprobs(actor, micro)
            mean_logp = repulse_losses.masked_mean_PK(logp, mask)
            weights = micro.weights_B.to(self.device)
            if kind == "policy":
                term = repulse_losses.policy_gradient_terms(mean_logp, weights).sum() / total
                return MicroLoss(term, {"policy_loss": term})
            term = repulse_losses.negative_terms(mean_logp, weights).sum() / total
            return MicroLoss(alpha * term, {"neg_term": term})

        stats: dict[str, float] = {}
        neg_steps = self._group_steps(negatives, Role.ACTOR) if with_negatives else None
        for i, micros in enumerate(self._group_steps(positives, Role.ACTOR)):
            items = [("policy", m) for m in micros] + ([("negative", m) for m in neg_steps[i]] if neg_steps else [])
            add_update(stats, step_metrics(actor.model, optimizer_step(actor.model, items, micro_loss)))
        return per_update_means(stats)


def describe_repulse(cfg: TrainRepulseConfig) -> str:
    """The algorithm line of a --do_harmlessness_training run: which variant, its weights and schedule."""
    rp, k = cfg.repulse, cfg.schedule.samples_per_prompt
    if rp.harmlessness_training_loss_type == "reinforce":
        variant = "REINFORCE (leave-one-out baseline)"
    elif rp.use_base_as_proposal:
        variant = f"REINFORCE + negatives from the policy's own samples (alpha {rp.alpha})"
    else:
        variant = (f"RePULSe: proposal q by {rp.actor_loss_type.upper()} toward p·exp({rp.target_dist_beta:g}·r) "
                   f"(lr {cfg.optim.actor_learning_rate:g}, {cfg.batch.num_episodes} update(s) per step), policy by "
                   f"REINFORCE + alpha {rp.alpha:g} x weighted q samples")
    parts = [variant, f"{k} samples per prompt", f"policy lr {rp.base_actor_learning_rate:g}"]
    if rp.reward_transform == "minus_alpha_exp_beta_r":
        parts.append(f"reward transform r - {rp.transform_alpha:g}·exp({rp.transform_beta:g}·r)")
    elif rp.reward_transform == "minus_alpha_ind":
        parts.append(f"reward transform r - {rp.transform_alpha:g}·1[r < {rp.threshold:g}]")
    a = cfg.algo
    parts.append(f"KL k1 x {a.init_kl_coef:g} in the return" if a.needs_ref else "no KL term")
    parts.append(f"{rp.fit_steps} fit step(s) of {rp.harmlessness_training_num_episodes} episode(s)")
    if rp.analytic_bad_word_calc:
        parts.append("exact log P(bad) after each fit step")
    return "algorithm: " + ", ".join(parts)
