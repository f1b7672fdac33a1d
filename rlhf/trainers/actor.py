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
    policy_token_loss_BT1,
    rollout_mismatch_BT1,
    sequence_mean_over_global_count,
    token_sum_over_global_count,
)
from rlhf.config.ppo_config import AlgoConfig
from rlhf.core.accumulate import MicroLoss, global_counts, optimizer_step, step_metrics
from rlhf.data.pretrain import PtxData
from rlhf.data.records import Experience
from rlhf.engines.deepspeed_engine import DeepSpeedModel
from rlhf.models.lm_logprobs import policy_forward
from rlhf.models.micro_batches import MicroBatcher, forward_in_micro_batches


def batched_logprobs(model: torch.nn.Module, sequences_BT: torch.Tensor, attention_mask_BT: torch.Tensor,
                     batcher: MicroBatcher, temperature: float, device: torch.device) -> torch.Tensor:
    """float32 [B, T-1] log-probs (on the CPU), one forward per micro-batch of `batcher`."""
    return forward_in_micro_batches(
        lambda ids, mask: policy_forward(model, ids, mask, temperature, layout=batcher.layout).logprobs_BT1,
        sequences_BT, attention_mask_BT, batcher, device, width=sequences_BT.shape[1] - 1)


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
                     num_seqs: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # no experience-time forward (one update per batch): the old log-probs are these, detached
        old = logprobs.detach() if exp.old_logprobs_BT1 is None else exp.old_logprobs_BT1.to(self.device)
        rollout = exp.rollout_logprobs_BT1.to(self.device) if exp.rollout_logprobs_BT1 is not None else None
        token_loss, clipped, clamped = policy_token_loss_BT1(
            logprobs, old, rollout, exp.advantages_BT1.to(self.device), action,
            loss_type=self.algo.policy_loss_type, clip_low=self.clip_low, clip_high=self.clip_high,
            dual_clip=self.algo.dual_clip, is_correction=self.algo.is_correction)
        if self.algo.policy_loss_type == "gspo":
            return sequence_mean_over_global_count(token_loss, action, num_seqs), clipped, clamped
        return token_sum_over_global_count(token_loss, action, num_tokens), clipped, clamped

    def train_batch(self, micro_batches: list[Experience], kl_coef: float,
                    ptx: PtxData | None = None) -> dict[str, float]:
        """One optimizer step over this rank's micro-batches; token means are over all DP ranks.

        Returns this rank's share of each loss term (sum over ranks = the global value), the grad norm and LR.
        """
        local = [sum(float(e.action_mask_BT1.sum()) for e in micro_batches),
                 sum(float((e.action_mask_BT1.sum(-1) > 0).sum()) for e in micro_batches)]
        num_tokens, num_seqs = global_counts(local, self.group, self.layout.ring_size)
        num_micro = len(micro_batches) * dist.get_world_size(self.group)  # aux loss: per rank's own tokens
        num_replica_micro = num_micro // self.layout.ring_size  # ptx: one loss per ring

        def micro_loss(exp: Experience) -> MicroLoss:
            action = exp.action_mask_BT1.to(self.device)
            out = policy_forward(self.model.engine, exp.sequences_BT.to(self.device),
                                 exp.attention_mask_BT.to(self.device), self.temperature,
                                 with_entropy=self.algo.entropy_loss_coef is not None, layout=self.layout)
            policy_loss, clipped, clamped = self._policy_term(exp, out.logprobs_BT1, action, num_tokens, num_seqs)
            loss = policy_loss
            terms = {"policy_loss": policy_loss, "clip_frac": token_sum_over_global_count(clipped, action, num_tokens),
                     "log_ratio_clamp_frac": token_sum_over_global_count(clamped, action, num_tokens)}
            if exp.old_logprobs_BT1 is None:  # the experience step had no actor forward to measure them with
                rollout = exp.rollout_logprobs_BT1.to(self.device)
                terms.update({name: token_sum_over_global_count(v, action, num_tokens) for name, v in
                              rollout_mismatch_BT1(out.logprobs_BT1, rollout, action,
                                                   self.algo.is_correction).items()})
            if exp.ref_logprobs_BT1 is not None:  # optional terms appear only when they apply
                kl = kl_estimate(out.logprobs_BT1, exp.ref_logprobs_BT1.to(self.device), self.algo.kl_estimator)
                terms["train_kl"] = token_sum_over_global_count(kl, action, num_tokens)
                if self.algo.use_kl_loss:
                    loss = loss + kl_coef * terms["train_kl"]
            if out.entropy_BT1 is not None:
                terms["entropy"] = token_sum_over_global_count(out.entropy_BT1, action, num_tokens)
                if self.algo.entropy_loss_coef:
                    loss = loss - self.algo.entropy_loss_coef * terms["entropy"]
            if out.aux_loss is not None and self.algo.aux_loss_coef:
                loss = loss + self.algo.aux_loss_coef * out.aux_loss / num_micro
            if ptx is not None:
                terms["ptx_loss"] = self._ptx_loss(*ptx.next()) / num_replica_micro
                loss = loss + self.algo.ptx_coef * terms["ptx_loss"]
            return MicroLoss(loss, terms, checked={"aux_loss": out.aux_loss})

        return step_metrics(self.model, optimizer_step(self.model, micro_batches, micro_loss))

    def _ptx_loss(self, ids_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
        """Mean next-token NLL of a pretraining micro-batch (the SFT loss), in the model's layout."""
        ids, mask = ids_BT.to(self.device), mask_BT.to(self.device)
        logprobs = policy_forward(self.model.engine, ids, mask, layout=self.layout).logprobs_BT1
        target_mask = mask[:, 1:].float()
        return -(logprobs * target_mask).sum() / target_mask.sum().clamp(min=1)
