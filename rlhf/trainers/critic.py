"""The critic role: per-token values at experience time and the clipped value-loss update.

Runs on the critic's data-parallel ranks over their shard of the experience. Values are aligned
with next-token targets: values_BT1[:, t] is the value of the state sequences[:, :t+1].
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlhf.algorithms.losses import token_sum_over_global_count, value_loss_BT1
from rlhf.core.accumulate import MicroLoss, global_counts, optimizer_step, step_metrics
from rlhf.data.records import Experience
from rlhf.engines.deepspeed_engine import DeepSpeedModel
from rlhf.models.micro_batches import MicroBatcher, forward_in_micro_batches
from rlhf.models.value import token_values


class Critic:
    """Value model being trained. All ranks of `group` call every method the same number of times.
    Micro-batching and layout as in `Actor`."""

    def __init__(self, model: DeepSpeedModel, group: dist.ProcessGroup, device: torch.device,
                 value_clip: float | None, *, infer_batcher: MicroBatcher, train_batcher: MicroBatcher) -> None:
        self.model, self.group, self.device, self.value_clip = model, group, device, value_clip
        self.infer_batcher, self.train_batcher = infer_batcher, train_batcher
        self.layout = train_batcher.layout

    def values(self, sequences_BT: torch.Tensor, attention_mask_BT: torch.Tensor) -> torch.Tensor:
        """float32 [B, T-1] values of every prefix state (results on the CPU)."""
        self.model.eval()
        return forward_in_micro_batches(
            lambda ids, mask: token_values(self.model.engine, ids, mask, self.layout)[:, :-1],
            sequences_BT, attention_mask_BT, self.infer_batcher, self.device, width=sequences_BT.shape[1] - 1)

    def train_batch(self, micro_batches: list[Experience]) -> dict[str, float]:
        """One optimizer step; the value loss is the token mean over all critic DP ranks."""
        (num_tokens,) = global_counts([sum(float(e.action_mask_BT1.sum()) for e in micro_batches)], self.group,
                                      self.layout.ring_size)

        def micro_loss(exp: Experience) -> MicroLoss:
            values = token_values(self.model.engine, exp.sequences_BT.to(self.device),
                                  exp.attention_mask_BT.to(self.device), self.layout)
            token_loss = value_loss_BT1(values[:, :-1], exp.values_BT1.to(self.device),
                                        exp.returns_BT1.to(self.device), self.value_clip)
            loss = token_sum_over_global_count(token_loss, exp.action_mask_BT1.to(self.device), num_tokens)
            return MicroLoss(loss, {"value_loss": loss})

        result = optimizer_step(self.model, micro_batches, micro_loss)
        return step_metrics(self.model, result, prefix="critic_", with_lr=False)
