"""The critic role: per-token values at experience time and the clipped value-loss update.

Runs on the critic's data-parallel ranks over their shard of the experience. Values are aligned
with next-token targets: values_BT1[:, t] is the value of the state sequences[:, :t+1].
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlhf.algorithms.losses import token_sum_over_global_count, value_loss_BT1
from rlhf.data.records import Experience
from rlhf.engines.deepspeed_engine import DeepSpeedModel, first_nonfinite
from rlhf.models.micro_batches import MicroBatcher, forward_in_micro_batches
from rlhf.models.value import token_values
from rlhf.trainers.actor import global_sum


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
        self.model.train()
        (num_tokens,) = global_sum([sum(float(e.action_mask_BT1.sum()) for e in micro_batches)], self.group)
        num_tokens = max(num_tokens / self.layout.ring_size, 1.0)
        stats = {"value_loss": 0.0}
        nonfinite = None  # the first non-finite loss of this optimizer step on this rank
        for i, exp in enumerate(micro_batches):
            action = exp.action_mask_BT1.to(self.device)
            values = token_values(self.model.engine, exp.sequences_BT.to(self.device),
                                  exp.attention_mask_BT.to(self.device), self.layout)
            token_loss = value_loss_BT1(values[:, :-1], exp.values_BT1.to(self.device),
                                        exp.returns_BT1.to(self.device), self.value_clip)
            loss = token_sum_over_global_count(token_loss, action, num_tokens)
            nonfinite = nonfinite or first_nonfinite({"value_loss": loss})
            self.model.backward(loss, last_micro_batch=i == len(micro_batches) - 1)
            applied = self.model.step(nonfinite)
            stats["value_loss"] += float(loss.detach())
        if not applied:  # skipped for a non-finite loss (see DeepSpeedModel.step): its loss is not logged
            return {"critic_nonfinite_skipped": 1.0}
        stats["critic_grad_norm"] = self.model.grad_norm()
        if self.model.max_nonfinite_steps:
            stats["critic_nonfinite_skipped"] = 0.0
        return stats
