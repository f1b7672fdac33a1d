"""The actor role: experience-time log-probs and the policy update (PPO-clip or GSPO with every
extra term of RL_MATH.md) on DeepSpeed.

Runs on the actor's data-parallel ranks, each on its shard of the step's experience. Knows nothing
about rewards, critics or rollout engines. Every collective here is over the actor DP group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlhf.algorithms.kl import kl_estimate
from rlhf.algorithms.losses import (
    gspo_loss_BT1,
    importance_weights_BT1,
    ppo_clip_loss_BT1,
    sequence_mean_over_global_count,
    token_sum_over_global_count,
)
from rlhf.config.ppo import AlgoConfig
from rlhf.data.pretrain import PtxData
from rlhf.data.records import Experience
from rlhf.engines.deepspeed_engine import DeepSpeedModel, first_nonfinite
from rlhf.models.logprobs import policy_forward
from rlhf.models.micro_batches import MicroBatcher, forward_in_micro_batches


def batched_logprobs(model: torch.nn.Module, sequences_BT: torch.Tensor, attention_mask_BT: torch.Tensor,
                     batcher: MicroBatcher, temperature: float, device: torch.device) -> torch.Tensor:
    """float32 [B, T-1] log-probs (on the CPU), one forward per micro-batch of `batcher`."""
    return forward_in_micro_batches(
        lambda ids, mask: policy_forward(model, ids, mask, temperature, layout=batcher.layout).logprobs_BT1,
        sequences_BT, attention_mask_BT, batcher, device, width=sequences_BT.shape[1] - 1)


def global_sum(values: list[float], group: dist.ProcessGroup) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return t.tolist()


class Actor:
    """Policy being trained. All ranks of `group` call every method the same number of times.

    `infer_batcher` and `train_batcher` cut experience-time and training batches into micro-batches; both carry the
    model's `SequenceLayout`. With ring attention the ranks of a ring hold the same samples: token
    counts summed over `group` are divided by the ring size.
    """

    def __init__(self, model: DeepSpeedModel, group: dist.ProcessGroup, device: torch.device, *,
                 temperature: float, algo: AlgoConfig, infer_batcher: MicroBatcher,
                 train_batcher: MicroBatcher) -> None:
        self.model, self.group, self.device = model, group, device
        self.temperature = temperature
        self.algo = algo
        self.clip_low, self.clip_high = algo.clip_range
        self.infer_batcher, self.train_batcher = infer_batcher, train_batcher
        self.layout = train_batcher.layout

    def logprobs(self, sequences_BT: torch.Tensor, attention_mask_BT: torch.Tensor) -> torch.Tensor:
        """float32 [B, T-1] log-probs under the current weights."""
        self.model.eval()
        return batched_logprobs(self.model.engine, sequences_BT, attention_mask_BT, self.infer_batcher,
                                self.temperature, self.device)

    def _policy_term(self, exp: Experience, logprobs: torch.Tensor, action: torch.Tensor, num_tokens: float,
                     num_seqs: float) -> tuple[torch.Tensor, torch.Tensor]:
        old, adv = exp.old_logprobs_BT1.to(self.device), exp.advantages_BT1.to(self.device)
        if self.algo.policy_loss_type == "gspo":
            token_loss, clipped = gspo_loss_BT1(logprobs, old, adv, action, self.clip_low, self.clip_high)
        else:
            token_loss, clipped = ppo_clip_loss_BT1(logprobs, old, adv, self.clip_low, self.clip_high,
                                                    self.algo.dual_clip)
        if self.algo.enable_vllm_is_correction:
            low, high = self.algo.vllm_is_truncated_threshold
            token_loss = token_loss * importance_weights_BT1(old, exp.rollout_logprobs_BT1.to(self.device), low,
                                                             high, self.algo.icepop)
        if self.algo.policy_loss_type == "gspo":
            return sequence_mean_over_global_count(token_loss, action, num_seqs), clipped
        return token_sum_over_global_count(token_loss, action, num_tokens), clipped

    def train_batch(self, micro_batches: list[Experience], kl_coef: float,
                    ptx: PtxData | None = None) -> dict[str, float]:
        """One optimizer step over this rank's micro-batches; token means are over all DP ranks.

        Returns this rank's share of each loss term (sum over ranks = the global value) and the grad norm.
        """
        self.model.train()
        ring = self.layout.ring_size
        local = [sum(float(e.action_mask_BT1.sum()) for e in micro_batches),
                 sum(float((e.action_mask_BT1.sum(-1) > 0).sum()) for e in micro_batches)]
        num_tokens, num_seqs = (max(v / ring, 1.0) for v in global_sum(local, self.group))
        num_micro = len(micro_batches) * dist.get_world_size(self.group)  # aux loss: per rank's own tokens
        num_replica_micro = num_micro // ring  # ptx: one loss per ring
        stats = {"policy_loss": 0.0, "clip_frac": 0.0}  # optional terms appear only when they apply
        nonfinite = None  # the first non-finite loss term of this optimizer step on this rank
        for i, exp in enumerate(micro_batches):
            action = exp.action_mask_BT1.to(self.device)
            out = policy_forward(self.model.engine, exp.sequences_BT.to(self.device),
                                 exp.attention_mask_BT.to(self.device), self.temperature,
                                 with_entropy=self.algo.entropy_loss_coef is not None, layout=self.layout)
            policy_loss, clipped = self._policy_term(exp, out.logprobs_BT1, action, num_tokens, num_seqs)
            loss = policy_loss
            stats["policy_loss"] += float(policy_loss.detach())
            stats["clip_frac"] += float(token_sum_over_global_count(clipped, action, num_tokens))
            if exp.ref_logprobs_BT1 is not None:
                kl = kl_estimate(out.logprobs_BT1, exp.ref_logprobs_BT1.to(self.device), self.algo.kl_estimator)
                kl_mean = token_sum_over_global_count(kl, action, num_tokens)
                stats["train_kl"] = stats.get("train_kl", 0.0) + float(kl_mean.detach())
                if self.algo.use_kl_loss:
                    loss = loss + kl_coef * kl_mean
            if out.entropy_BT1 is not None:
                entropy = token_sum_over_global_count(out.entropy_BT1, action, num_tokens)
                stats["entropy"] = stats.get("entropy", 0.0) + float(entropy.detach())
                if self.algo.entropy_loss_coef:
                    loss = loss - self.algo.entropy_loss_coef * entropy
            if out.aux_loss is not None and self.algo.aux_loss_coef:
                loss = loss + self.algo.aux_loss_coef * out.aux_loss / num_micro
            if ptx is not None:
                ptx_loss = self._ptx_loss(*ptx.next())
                stats["ptx_loss"] = stats.get("ptx_loss", 0.0) + float(ptx_loss.detach()) / num_replica_micro
                loss = loss + self.algo.ptx_coef * ptx_loss / num_replica_micro
            nonfinite = nonfinite or first_nonfinite({
                "policy_loss": policy_loss, "train_kl": kl_mean if exp.ref_logprobs_BT1 is not None else None,
                "entropy": entropy if out.entropy_BT1 is not None else None, "aux_loss": out.aux_loss,
                "ptx_loss": ptx_loss if ptx is not None else None, "loss": loss})
            self.model.backward(loss, last_micro_batch=i == len(micro_batches) - 1)
            applied = self.model.step(nonfinite)
        if not applied:  # skipped for a non-finite term (see DeepSpeedModel.step): its losses are not logged
            return {"nonfinite_skipped": 1.0, "lr": self.model.learning_rate()}
        stats["grad_norm"] = self.model.grad_norm()
        stats["lr"] = self.model.learning_rate()
        if self.model.max_nonfinite_steps:
            stats["nonfinite_skipped"] = 0.0
        return stats

    def _ptx_loss(self, ids_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
        """Mean next-token NLL of a pretraining micro-batch (the SFT loss), in the model's layout."""
        ids, mask = ids_BT.to(self.device), mask_BT.to(self.device)
        logprobs = policy_forward(self.model.engine, ids, mask, layout=self.layout).logprobs_BT1
        target_mask = mask[:, 1:].float()
        return -(logprobs * target_mask).sum() / target_mask.sum().clamp(min=1)
