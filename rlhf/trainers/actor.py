"""The actor role: experience-time log-probs and the PPO-clip policy update on DeepSpeed.

Runs on the actor's data-parallel ranks. Receives experiences already holding advantages; knows
nothing about rewards or rollout engines. Every collective here is over the actor DP group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlhf.algorithms.losses import ppo_clip_loss_BT1, token_sum_over_global_count
from rlhf.data.records import Experience
from rlhf.engines.deepspeed_engine import DeepSpeedModel
from rlhf.models.logprobs import sequence_logprobs


class Actor:
    """Policy being trained. All ranks of `group` call every method the same number of times."""

    def __init__(self, model: DeepSpeedModel, group: dist.ProcessGroup, device: torch.device, *,
                 temperature: float, clip_range: tuple[float, float]) -> None:
        self.model = model
        self.group = group
        self.device = device
        self.temperature = temperature
        self.clip_low, self.clip_high = clip_range

    @torch.no_grad()
    def logprobs(self, sequences_BT: torch.Tensor, attention_mask_BT: torch.Tensor,
                 micro_batch_size: int) -> torch.Tensor:
        """float32 [B, T-1] log-probs under the current weights, `micro_batch_size` samples per forward."""
        self.model.eval()
        chunks = []
        for start in range(0, sequences_BT.shape[0], micro_batch_size):
            seq = sequences_BT[start:start + micro_batch_size].to(self.device)
            mask = attention_mask_BT[start:start + micro_batch_size].to(self.device)
            chunks.append(sequence_logprobs(self.model.engine, seq, mask, self.temperature).float().cpu())
        return torch.cat(chunks)

    def _global_tokens(self, batch: list[Experience]) -> float:
        count = torch.tensor([sum(float(e.action_mask_BT1.sum()) for e in batch)], dtype=torch.float64)
        dist.all_reduce(count, group=self.group)
        return float(count.item())

    def train_batch(self, micro_batches: list[Experience]) -> dict[str, float]:
        """One optimizer step over this rank's micro-batches; loss is the token mean over all DP ranks.

        Returns sums over this rank's micro-batches of the token-normalised loss and clip statistics
        (add them up over ranks to get the global values) and the grad norm.
        """
        self.model.train()
        num_tokens = self._global_tokens(micro_batches)
        stats = {"policy_loss": 0.0, "clip_frac": 0.0, "approx_kl": 0.0}
        for exp in micro_batches:
            seq, mask = exp.sequences_BT.to(self.device), exp.attention_mask_BT.to(self.device)
            action = exp.action_mask_BT1.to(self.device)
            old = exp.old_logprobs_BT1.to(self.device)
            logprobs = sequence_logprobs(self.model.engine, seq, mask, self.temperature)
            token_loss, clipped = ppo_clip_loss_BT1(logprobs, old, exp.advantages_BT1.to(self.device),
                                                    self.clip_low, self.clip_high)
            loss = token_sum_over_global_count(token_loss, action, num_tokens)
            self.model.backward(loss)
            self.model.step()
            stats["policy_loss"] += float(loss.detach())
            stats["clip_frac"] += float(token_sum_over_global_count(clipped, action, num_tokens))
            stats["approx_kl"] += float(token_sum_over_global_count((old - logprobs.detach()), action, num_tokens))
        stats["grad_norm"] = self.model.grad_norm()
        stats["lr"] = self.model.learning_rate()
        return stats
