"""One step of knowledge distillation (`train_kd`): the student's next-token NLL on the target tokens mixed
with the forward KL from a frozen teacher over the full vocabulary, (1 - kd_coef) x NLL + kd_coef x KD, both
token sums over the target tokens divided by their count in the whole global batch. The KD term runs the
chunked kernel (`rlhf.kernels.kd_loss_chunked`), so the float32 softmaxes of both models over B x T x V are
never held at once. The teacher is a colocated frozen role, optionally offloaded outside its forward.

A `rlhf.train.loop.Job`; knows the two model wrappers, the sampler and the SFT record.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlhf.algorithms.sft import nll_over_global_count
from rlhf.data.sampler import DistributedBatchSampler
from rlhf.data.supervised import SFTBatch, SFTSample
from rlhf.distributed.topology import Role, Topology
from rlhf.engines.deepspeed_engine import DeepSpeedModel
from rlhf.kernels import kd_loss_chunked
from rlhf.models.logprobs import logprobs_entropy
from rlhf.models.micro_batches import MicroBatcher
from rlhf.train.accumulate import MicroLoss, global_counts, optimizer_step, step_metrics
from rlhf.train.metrics import Reduce, reduce_metrics
from rlhf.train.state import CheckpointedState
from rlhf.utils.timers import StageTimer

TEACHER = Role.define("teacher")

KD_METRICS = {**dict.fromkeys(("gpt_loss", "distil_loss"), Reduce.SHARE),
              **dict.fromkeys(("grad_norm", "lr", "nonfinite_skipped"), Reduce.LEAD)}


class DistillationTrainer:
    """KD on the ranks of `Role.ACTOR` with the teacher (`TEACHER`) on the same ranks."""

    def __init__(self, model: DeepSpeedModel, teacher: DeepSpeedModel, topology: Topology, samples: list[SFTSample],
                 eval_samples: list[SFTSample], sampler: DistributedBatchSampler, batcher: MicroBatcher,
                 tokenizer, device: torch.device, *, kd_coef: float, teacher_offload: bool) -> None:
        self.model, self.teacher, self.topology = model, teacher, topology
        self.samples, self.eval_samples, self.sampler, self.batcher = samples, eval_samples, sampler, batcher
        self.tokenizer, self.device = tokenizer, device
        self.kd_coef, self.teacher_offload = kd_coef, teacher_offload
        self.group = topology.group(Role.ACTOR)
        self.timer = StageTimer()

    def _micro_batches(self, samples: list[SFTSample]) -> list[SFTBatch]:
        batch = SFTBatch.collate(samples, self.tokenizer.pad_token_id)
        return [batch.select(torch.tensor(rows)).trimmed() for rows in self.batcher.split(batch.attention_mask_BT)]

    def _terms(self, batch: SFTBatch, num_tokens: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(NLL, KD) of one micro-batch, each a token sum over its targets / `num_tokens`."""
        ids, mask = batch.input_ids_BT.to(self.device), batch.attention_mask_BT.to(self.device)
        layout = self.batcher.layout
        laid = layout.lay_out(ids, mask)
        with torch.no_grad():
            teacher_logits = self.teacher.engine(**laid.kwargs).logits
        logits = self.model.engine(**laid.kwargs).logits
        logprobs, _ = logprobs_entropy(logits, laid.targets)
        loss_mask = batch.loss_mask_BT1.to(self.device)
        nll = nll_over_global_count(laid.to_padded(logprobs)[:, :-1], loss_mask, num_tokens)
        # the logits at position t predict token t + 1: distil exactly where the NLL has a target
        kd = kd_loss_chunked(laid.to_padded(logits)[:, :-1], laid.to_padded(teacher_logits)[:, :-1],
                             loss_mask, num_tokens=num_tokens)
        return nll, kd

    def step(self, step: int) -> dict[str, float]:
        assert self.sampler.step == step, f"sampler at step {self.sampler.step}, loop at {step}"
        micro_batches = self._micro_batches([self.samples[i] for i in self.sampler.next()])
        (num_tokens,) = global_counts([sum(float(m.loss_mask_BT1.sum()) for m in micro_batches)], self.group,
                                      self.batcher.layout.ring_size)
        with self.timer.stage("train"):
            if self.teacher_offload:
                self.teacher.reload(self.device)
            self.teacher.eval()

            def micro_loss(batch: SFTBatch) -> MicroLoss:
                nll, kd = self._terms(batch, num_tokens)
                return MicroLoss((1 - self.kd_coef) * nll + self.kd_coef * kd, {"gpt_loss": nll, "distil_loss": kd})

            stats = step_metrics(self.model, optimizer_step(self.model, micro_batches, micro_loss))
            if self.teacher_offload:
                self.teacher.offload()
        return reduce_metrics({Role.ACTOR: stats}, KD_METRICS, self.topology)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out token-mean NLL and KD of the student. Collective over the world."""
        if not self.eval_samples:
            return {}
        self.model.eval()
        if self.teacher_offload:
            self.teacher.reload(self.device)
        dp, rank = self.topology.dp_size(Role.ACTOR), self.topology.dp_rank(Role.ACTOR)
        mine = [self.eval_samples[i] for i in range(rank, len(self.eval_samples), dp)]
        sums = torch.zeros(3, dtype=torch.float64)  # NLL sum, KD sum, tokens
        for batch in self._micro_batches(mine) if mine else []:
            nll, kd = self._terms(batch, 1.0)  # sums over the micro-batch's targets
            sums += torch.tensor([float(nll), float(kd), float(batch.loss_mask_BT1.sum())], dtype=torch.float64)
        if self.teacher_offload:
            self.teacher.offload()
        if self.topology.ring_rank(Role.ACTOR) != 0:
            sums.zero_()
        dist.all_reduce(sums)
        nll, kd, tokens = sums.tolist()
        return {"eval_gpt_loss": nll / max(tokens, 1.0), "eval_distil_loss": kd / max(tokens, 1.0)}

    def checkpointed(self) -> CheckpointedState:
        def hf(directory: str) -> None:
            self.model.save_hf(directory, self.tokenizer, self.topology.leads(Role.ACTOR))

        return CheckpointedState(engines={"model": self.model}, components={"sampler": self.sampler}, hf_export=hf)
