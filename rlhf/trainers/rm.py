"""One step of reward-model training (`train_rm`): each pair's chosen and rejected sequences in one forward,
the scalar head read at each sequence's last token, the pairwise loss summed over pairs and divided by the
pairs of the whole global batch. Evaluation gives held-out accuracy and the reward mean/std that the saved
model stores in its config (OpenRLHF's normalisation, applied with --normalize_reward where it is loaded).

A `rlhf.train.loop.Job`; knows the model wrapper, the sampler and the pair record, not launchers or flags.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from rlhf.algorithms.reward_model import PAIRWISE_LOSSES
from rlhf.data.sampler import DistributedBatchSampler
from rlhf.data.supervised import PairBatch, PairSample
from rlhf.distributed.topology import Role, Topology
from rlhf.engines.deepspeed_engine import DeepSpeedModel
from rlhf.models.micro_batches import MicroBatcher
from rlhf.models.value import last_token_values, save_scalar_head_model, token_values
from rlhf.train.accumulate import MicroLoss, global_counts, optimizer_step, step_metrics
from rlhf.train.metrics import Reduce, reduce_metrics
from rlhf.train.state import CheckpointedState
from rlhf.utils.timers import StageTimer

RM_METRICS = {**dict.fromkeys(("loss", "acc", "chosen_reward", "reject_reward"), Reduce.SHARE),
              **dict.fromkeys(("grad_norm", "lr", "nonfinite_skipped"), Reduce.LEAD)}


class RewardStats:
    """The reward mean and std of the last evaluation (stored in the saved model's config); checkpointed."""

    def __init__(self) -> None:
        self.mean: float | None = None
        self.std: float | None = None

    def state_dict(self) -> dict:
        return {"mean": self.mean, "std": self.std}

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.std = state["mean"], state["std"]


class RewardModelTrainer:
    """Pairwise reward-model training on the ranks of `Role.ACTOR` (every rank)."""

    def __init__(self, model: DeepSpeedModel, topology: Topology, samples: list[PairSample],
                 eval_samples: list[PairSample], sampler: DistributedBatchSampler, batcher: MicroBatcher,
                 tokenizer, device: torch.device, *, loss: str, margin_loss: bool) -> None:
        self.model, self.topology, self.samples, self.eval_samples = model, topology, samples, eval_samples
        self.sampler, self.batcher, self.tokenizer, self.device = sampler, batcher, tokenizer, device
        self.loss_fn = PAIRWISE_LOSSES[loss]
        self.margin_loss = margin_loss and loss == "sigmoid"
        self.group = topology.group(Role.ACTOR)
        self.stats = RewardStats()
        self.timer = StageTimer()

    def _rewards(self, batch: PairBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen_B, rejected_B): both halves of the pairs in one forward."""
        ids, mask = batch.concatenated()
        ids, mask = ids.to(self.device), mask.to(self.device)
        values = token_values(self.model.engine, ids, mask, self.batcher.layout)
        rewards = last_token_values(values, mask)
        B = batch.num_samples
        return rewards[:B], rewards[B:]

    def _batches(self, samples: list[PairSample]) -> list[PairBatch]:
        batch = PairBatch.collate(samples, self.tokenizer.pad_token_id)
        both = torch.cat([batch.chosen_mask_BT, batch.rejected_mask_BT], dim=1)  # cost: the longer of the two
        return [batch.select(torch.tensor(rows)).trimmed() for rows in self.batcher.split(both)]

    def step(self, step: int) -> dict[str, float]:
        assert self.sampler.step == step, f"sampler at step {self.sampler.step}, loop at {step}"
        with self.timer.stage("train"):
            micro_batches = self._batches([self.samples[i] for i in self.sampler.next()])
            (num_pairs,) = global_counts([sum(m.num_samples for m in micro_batches)], self.group,
                                         self.batcher.layout.ring_size)

            def micro_loss(batch: PairBatch) -> MicroLoss:
                chosen, rejected = self._rewards(batch)
                margin = batch.margins_B.to(self.device) if self.margin_loss and batch.margins_B is not None else None
                loss = self.loss_fn(chosen, rejected, margin).sum() / num_pairs
                return MicroLoss(loss, {"loss": loss, "acc": (chosen > rejected).float().sum() / num_pairs,
                                        "chosen_reward": chosen.sum() / num_pairs,
                                        "reject_reward": rejected.sum() / num_pairs})

            stats = step_metrics(self.model, optimizer_step(self.model, micro_batches, micro_loss))
        return reduce_metrics({Role.ACTOR: stats}, RM_METRICS, self.topology)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out loss, accuracy and reward mean/std (over chosen and rejected rewards, as OpenRLHF; the std
        with Bessel's correction). Collective over the world."""
        if not self.eval_samples:
            return {}
        self.model.eval()
        dp, rank = self.topology.dp_size(Role.ACTOR), self.topology.dp_rank(Role.ACTOR)
        mine = [self.eval_samples[i] for i in range(rank, len(self.eval_samples), dp)]
        sums = torch.zeros(5, dtype=torch.float64)  # pairs, loss, correct, reward sum, reward square sum
        for batch in self._batches(mine) if mine else []:
            chosen, rejected = self._rewards(batch)
            margin = batch.margins_B.to(self.device) if self.margin_loss and batch.margins_B is not None else None
            both = torch.cat([chosen, rejected]).double()
            sums += torch.tensor([batch.num_samples, float(self.loss_fn(chosen, rejected, margin).sum()),
                                  float((chosen > rejected).sum()), float(both.sum()), float((both * both).sum())],
                                 dtype=torch.float64)
        if self.topology.ring_rank(Role.ACTOR) != 0:  # the ranks of a ring score the same pairs
            sums.zero_()
        dist.all_reduce(sums)
        pairs, loss, correct, total, squares = sums.tolist()
        n = 2 * pairs
        mean = total / n
        std = max(math.sqrt(max(squares - n * mean * mean, 0.0) / max(n - 1, 1)), 1e-8)
        self.stats.mean, self.stats.std = mean, std
        return {"eval_loss": loss / pairs, "eval_acc": correct / pairs, "eval_reward_mean": mean,
                "eval_reward_std": std}

    def save_hf(self, directory: str) -> None:
        """The model as a sequence-classification checkpoint, with the reward mean/std of the last evaluation
        in its config (collective)."""
        is_writer = self.topology.leads(Role.ACTOR)
        state = self.model.gathered_state_dict(is_writer)
        if is_writer:
            module = self.model.module
            extra = {"mean": self.stats.mean, "std": self.stats.std} if self.stats.mean is not None else {}
            save_scalar_head_model(state, module.config, module.head_prefix, directory, self.tokenizer, extra)

    def checkpointed(self) -> CheckpointedState:
        return CheckpointedState(engines={"model": self.model},
                                 components={"sampler": self.sampler, "reward_stats": self.stats},
                                 hf_export=self.save_hf)
