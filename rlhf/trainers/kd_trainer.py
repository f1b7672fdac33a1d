"""One step of knowledge distillation (`train_kd`): the student's next-token NLL on the target tokens mixed
with the cross-entropy to a frozen teacher's distribution over the full vocabulary (the forward KL plus the
teacher's entropy: the same gradient, as OpenRLHF's `KDLoss`), (1 - kd_coef) x NLL + kd_coef x KD, both
token sums over the target tokens divided by their count in the whole global batch. The KD term runs the
chunked kernel (`rlhf.kernels.kd_loss_chunked`), so the float32 softmaxes of both models over B x T x V are
never held at once. The teacher is a colocated frozen role, optionally offloaded outside its forward.

A `rlhf.core.loop.Job`; knows the two model wrappers, the sampler and the SFT record.
"""

from __future__ import annotations

import torch

from rlhf.algorithms.sft_loss import nll_over_global_count
from rlhf.core.accumulate import MicroLoss, global_counts, optimizer_step, step_metrics
from rlhf.core.metrics import Reduce
from rlhf.data.supervised_samples import SFTBatch
from rlhf.distributed.topology import Role
from rlhf.kernels import kd_loss_chunked
from rlhf.models.lm_logprobs import logprobs_entropy
from rlhf.trainers.frozen import Frozen
from rlhf.trainers.supervised_trainer import SupervisedTrainer

TEACHER = Role.define("teacher")


KD_METRICS = {**dict.fromkeys(("gpt_loss", "distil_loss"), Reduce.SHARE),
              **dict.fromkeys(("grad_norm", "lr", "nonfinite_skipped"), Reduce.LEAD)}


class DistillationTrainer(SupervisedTrainer):
    """KD on the ranks of `MODEL`, the teacher colocated or on its own ranks (answering `padded_logits`)."""

    batch_type = SFTBatch
    metrics = KD_METRICS
    eval_sums = (3,)

    def __init__(self, *args, teacher: Frozen, kd_coef: float) -> None:
        super().__init__(*args)
        self.teacher, self.kd_coef = teacher, kd_coef

    def _terms(self, batch: SFTBatch, num_tokens: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(NLL, KD) of one micro-batch, each a token sum over its targets / `num_tokens`."""
        ids, mask = batch.input_ids_BT.to(self.device), batch.attention_mask_BT.to(self.device)
        laid = self.batcher.layout.lay_out(ids, mask)
        teacher_padded = self.teacher.request(ids, mask)
        logits = self.model.engine(**laid.kwargs).logits
        logprobs, _ = logprobs_entropy(logits, laid.targets)
        loss_mask = batch.loss_mask_BT1.to(self.device)
        nll = nll_over_global_count(laid.to_padded(logprobs)[:, :-1], loss_mask, num_tokens)
        # the logits at position t predict token t + 1: distil exactly where the NLL has a target
        kd = kd_loss_chunked(laid.to_padded(logits)[:, :-1], teacher_padded[:, :-1], loss_mask, num_tokens=num_tokens)
        return nll, kd

    def step(self, step: int) -> dict[str, float]:
        micro_batches = self.next_micro_batches(step)
        (num_tokens,) = global_counts([sum(float(m.loss_mask_BT1.sum()) for m in micro_batches)], self.group,
                                      self.batcher.layout.ring_size)
        with self.timer.stage("train"):
            self.teacher.begin(len(micro_batches))

            def micro_loss(batch: SFTBatch) -> MicroLoss:
                nll, kd = self._terms(batch, num_tokens)
                return MicroLoss((1 - self.kd_coef) * nll + self.kd_coef * kd, {"gpt_loss": nll, "distil_loss": kd})

            stats = step_metrics(self.model, optimizer_step(self.model, micro_batches, micro_loss))
            self.teacher.end()
        return self.reduced(stats)

    def eval_scores(self, items: list):
        """NLL sum, KD sum and target tokens of each micro-batch, the teacher answering in one phase."""
        self.teacher.begin(len(items))
        for batch in items:
            nll, kd = self._terms(batch, 1.0)  # sums over the micro-batch's targets
            yield nll, kd, batch.loss_mask_BT1.sum()
        self.teacher.end()

    def eval_metrics(self, totals: list[float]) -> dict[str, float]:
        """Held-out token-mean NLL and KD of the student."""
        nll, kd, tokens = totals
        return {"eval_gpt_loss": nll / max(tokens, 1.0), "eval_distil_loss": kd / max(tokens, 1.0)}
