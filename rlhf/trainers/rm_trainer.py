"""One step of reward-model training (`train_rm`): each pair's chosen and rejected sequences in one forward,
the scalar head read at each sequence's last token, the pairwise loss summed over pairs and divided by the
pairs of the whole global batch. Evaluation gives held-out accuracy and the reward mean/std that the saved
model stores in its config (OpenRLHF's normalisation, applied with --normalize_reward where it is loaded).

A `rlhf.core.loop.Job`; knows the model wrapper, the sampler and the pair record, not launchers or flags.
"""

from __future__ import annotations

import math

import torch

from rlhf.algorithms.reward_model import PAIRWISE_LOSSES
from rlhf.core.accumulate import MicroLoss, global_counts, optimizer_step, step_metrics
from rlhf.core.metrics import Reduce
from rlhf.core.state import CheckpointedState
from rlhf.data.supervised_samples import PairBatch
from rlhf.models.value import last_token_values, save_scalar_head_model, token_values
from rlhf.trainers.supervised_trainer import MODEL, SupervisedTrainer

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


class RewardModelTrainer(SupervisedTrainer):
    """Pairwise reward-model training on the ranks of `MODEL` (every rank)."""

    batch_type = PairBatch
    metrics = RM_METRICS
    eval_sums = (5,)

    def __init__(self, *args, loss: str, margin_loss: bool) -> None:
        super().__init__(*args)
        self.loss_fn = PAIRWISE_LOSSES[loss]
        self.margin_loss = margin_loss and loss == "sigmoid"
        self.stats = RewardStats()

    def cost_mask(self, batch: PairBatch) -> torch.Tensor:
        return torch.cat([batch.chosen_mask_BT, batch.rejected_mask_BT], dim=1)  # both halves are run

    def _rewards(self, batch: PairBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(chosen_B, rejected_B, margin_B or None): both halves of the pairs in one forward."""
        ids, mask = batch.concatenated()
        ids, mask = ids.to(self.device), mask.to(self.device)
        rewards = last_token_values(token_values(self.model.engine, ids, mask, self.batcher.layout), mask)
        B = batch.num_samples
        margin = batch.margins_B.to(self.device) if self.margin_loss and batch.margins_B is not None else None
        return rewards[:B], rewards[B:], margin

    def step(self, step: int) -> dict[str, float]:
        with self.timer.stage("train"):
            micro_batches = self.next_micro_batches(step)
            (num_pairs,) = global_counts([sum(m.num_samples for m in micro_batches)], self.group,
                                         self.batcher.layout.ring_size)

            def micro_loss(batch: PairBatch) -> MicroLoss:
                chosen, rejected, margin = self._rewards(batch)
                loss = self.loss_fn(chosen, rejected, margin).sum() / num_pairs
                return MicroLoss(loss, {"loss": loss, "acc": (chosen > rejected).float().sum() / num_pairs,
                                        "chosen_reward": chosen.sum() / num_pairs,
                                        "reject_reward": rejected.sum() / num_pairs})

            stats = step_metrics(self.model, optimizer_step(self.model, micro_batches, micro_loss))
        return self.reduced(stats)

    def eval_scores(self, items: list):
        """Pairs, loss sum, correct pairs, and the sum and square sum of the chosen and rejected rewards."""
        for batch in items:
            chosen, rejected, margin = self._rewards(batch)
            both = torch.cat([chosen, rejected]).double()
            yield (batch.num_samples, self.loss_fn(chosen, rejected, margin).sum(), (chosen > rejected).sum(),
                   both.sum(), (both * both).sum())

    def eval_metrics(self, totals: list[float]) -> dict[str, float]:
        """Held-out loss, accuracy and reward mean/std (over chosen and rejected rewards, as OpenRLHF; the std
        with Bessel's correction), which the saved model keeps."""
        pairs, loss, correct, total, squares = totals
        n = 2 * pairs
        mean = total / n
        std = max(math.sqrt(max(squares - n * mean * mean, 0.0) / max(n - 1, 1)), 1e-8)
        self.stats.mean, self.stats.std = mean, std
        return {"eval_loss": loss / pairs, "eval_acc": correct / pairs, "eval_reward_mean": mean,
                "eval_reward_std": std}

    def save_hf(self, directory: str) -> None:
        """The model as a sequence-classification checkpoint, with the reward mean/std of the last evaluation
        in its config; with LoRA, the adapter and head with the mean/std in its config.json (collective)."""
        is_writer = self.topology.leads(MODEL)
        extra = {"mean": self.stats.mean, "std": self.stats.std} if self.stats.mean is not None else {}
        if self.model.adapted:  # the adapter and head (as OpenRLHF); `lora_combiner --is_rm` merges them
            self.model.save_hf(directory, self.tokenizer, is_writer, extra or None)
            return
        state = self.model.gathered_state_dict(is_writer)
        if is_writer:
            module = self.model.module
            save_scalar_head_model(state, module.config, module.head_prefix, directory, self.tokenizer, extra)

    def checkpointed(self) -> CheckpointedState:
        state = super().checkpointed()
        state.components["reward_stats"] = self.stats
        return state
