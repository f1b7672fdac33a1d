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
from rlhf.data.supervised import SFTBatch
from rlhf.distributed.topology import Role, Topology
from rlhf.engines.deepspeed_engine import DeepSpeedModel
from rlhf.kernels import kd_loss_chunked
from rlhf.models.logprobs import logprobs_entropy
from rlhf.train.accumulate import MicroLoss, global_counts, optimizer_step, step_metrics
from rlhf.train.metrics import Reduce, reduce_metrics
from rlhf.train.state import CheckpointedState
from rlhf.trainers.supervised import SupervisedTrainer
from rlhf.utils.timers import StageTimer

TEACHER = Role.define("teacher")


class TeacherLink:
    """A student rank's connection to its teacher rank when the teacher runs on its own ranks (point-to-point,
    in the order `serve_teacher` answers: a phase's micro-batch count, then per micro-batch the batch shape,
    the token ids and the attention mask, answered with float32 padded logits [B, T, V])."""

    def __init__(self, teacher_rank: int, vocab_size: int) -> None:
        self.teacher_rank, self.vocab_size = teacher_rank, vocab_size

    def begin(self, num_micro_batches: int) -> None:
        dist.send(torch.tensor([num_micro_batches], dtype=torch.int64), self.teacher_rank)

    def logits(self, ids_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
        dist.send(torch.tensor(list(ids_BT.shape), dtype=torch.int64), self.teacher_rank)
        dist.send(ids_BT.cpu().to(torch.int64).contiguous(), self.teacher_rank)
        dist.send(mask_BT.cpu().to(torch.int64).contiguous(), self.teacher_rank)
        out = torch.empty(*ids_BT.shape, self.vocab_size, dtype=torch.float32)
        dist.recv(out, self.teacher_rank)
        return out.to(ids_BT.device)


def serve_teacher(teacher: DeepSpeedModel, students: list[int], layout, device: torch.device) -> None:
    """One phase (a training step or an evaluation) on a teacher rank: read each student's micro-batch count,
    then answer round-robin, micro-batch i of every student before micro-batch i + 1 of any, so students that
    meet in a collective between micro-batches are never waiting on each other's logits."""
    counts = []
    for rank in students:
        n = torch.zeros(1, dtype=torch.int64)
        dist.recv(n, rank)
        counts.append(int(n))
    teacher.eval()
    for i in range(max(counts, default=0)):
        for rank, n in zip(students, counts):
            if i >= n:
                continue
            shape = torch.zeros(2, dtype=torch.int64)
            dist.recv(shape, rank)
            ids, mask = torch.empty(*shape.tolist(), dtype=torch.int64), torch.empty(*shape.tolist(), dtype=torch.int64)
            dist.recv(ids, rank)
            dist.recv(mask, rank)
            with torch.no_grad():
                laid = layout.lay_out(ids.to(device), mask.to(device))
                logits = laid.to_padded(teacher.engine(**laid.kwargs).logits)
            dist.send(logits.float().cpu().contiguous(), rank)

KD_METRICS = {**dict.fromkeys(("gpt_loss", "distil_loss"), Reduce.SHARE),
              **dict.fromkeys(("grad_norm", "lr", "nonfinite_skipped"), Reduce.LEAD)}


class DistillationTrainer(SupervisedTrainer):
    """KD on the ranks of `Role.ACTOR`, the teacher colocated (a model) or on its own ranks (a link)."""

    batch_type = SFTBatch
    metrics = KD_METRICS

    def __init__(self, *args, teacher: DeepSpeedModel | TeacherLink, kd_coef: float, teacher_offload: bool) -> None:
        super().__init__(*args)
        self.teacher = teacher if isinstance(teacher, DeepSpeedModel) else None
        self.link = teacher if isinstance(teacher, TeacherLink) else None
        self.kd_coef, self.teacher_offload = kd_coef, teacher_offload and self.teacher is not None

    def _terms(self, batch: SFTBatch, num_tokens: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(NLL, KD) of one micro-batch, each a token sum over its targets / `num_tokens`."""
        ids, mask = batch.input_ids_BT.to(self.device), batch.attention_mask_BT.to(self.device)
        laid = self.batcher.layout.lay_out(ids, mask)
        if self.link is not None:
            teacher_padded = self.link.logits(ids, mask)
        else:
            with torch.no_grad():
                teacher_padded = laid.to_padded(self.teacher.engine(**laid.kwargs).logits)
        logits = self.model.engine(**laid.kwargs).logits
        logprobs, _ = logprobs_entropy(logits, laid.targets)
        loss_mask = batch.loss_mask_BT1.to(self.device)
        nll = nll_over_global_count(laid.to_padded(logprobs)[:, :-1], loss_mask, num_tokens)
        # the logits at position t predict token t + 1: distil exactly where the NLL has a target
        kd = kd_loss_chunked(laid.to_padded(logits)[:, :-1], teacher_padded[:, :-1], loss_mask, num_tokens=num_tokens)
        return nll, kd

    def _teacher_ready(self, num_micro_batches: int) -> None:
        if self.teacher_offload:
            self.teacher.reload(self.device)
        if self.teacher is not None:
            self.teacher.eval()
        if self.link is not None:
            self.link.begin(num_micro_batches)

    def _teacher_done(self) -> None:
        if self.teacher_offload:
            self.teacher.offload()

    def step(self, step: int) -> dict[str, float]:
        micro_batches = self.next_micro_batches(step)
        (num_tokens,) = global_counts([sum(float(m.loss_mask_BT1.sum()) for m in micro_batches)], self.group,
                                      self.batcher.layout.ring_size)
        with self.timer.stage("train"):
            self._teacher_ready(len(micro_batches))

            def micro_loss(batch: SFTBatch) -> MicroLoss:
                nll, kd = self._terms(batch, num_tokens)
                return MicroLoss((1 - self.kd_coef) * nll + self.kd_coef * kd, {"gpt_loss": nll, "distil_loss": kd})

            stats = step_metrics(self.model, optimizer_step(self.model, micro_batches, micro_loss))
            self._teacher_done()
        return self.reduced(stats)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out token-mean NLL and KD of the student. Collective over the world."""
        if not self.eval_samples:
            return {}
        self.model.eval()
        batches = self.eval_micro_batches()
        self._teacher_ready(len(batches))
        sums = [0.0, 0.0, 0.0]  # NLL sum, KD sum, tokens
        for batch in batches:
            nll, kd = self._terms(batch, 1.0)  # sums over the micro-batch's targets
            for i, v in enumerate((float(nll), float(kd), float(batch.loss_mask_BT1.sum()))):
                sums[i] += v
        self._teacher_done()
        nll, kd, tokens = self.world_sums(sums)
        return {"eval_gpt_loss": nll / max(tokens, 1.0), "eval_distil_loss": kd / max(tokens, 1.0)}


class TeacherService:
    """The `Job` of a teacher on its own ranks: each step (and evaluation) answers its students' requests, then
    takes part in the step's metric reduction with nothing of its own. Holds no checkpointed state."""

    def __init__(self, teacher: DeepSpeedModel, topology: Topology, layout, device: torch.device,
                 has_eval: bool) -> None:
        self.teacher, self.topology, self.layout, self.device = teacher, topology, layout, device
        self.has_eval = has_eval
        teachers, students = topology.ranks(TEACHER), topology.ranks(Role.ACTOR)
        mine = teachers.index(topology.rank)
        self.students = [r for i, r in enumerate(students) if i % len(teachers) == mine]
        self.timer = StageTimer()

    def step(self, step: int) -> dict[str, float]:
        with self.timer.stage("train"):
            serve_teacher(self.teacher, self.students, self.layout, self.device)
        return reduce_metrics({}, KD_METRICS, self.topology)

    def evaluate(self) -> dict[str, float]:
        if not self.has_eval:
            return {}
        serve_teacher(self.teacher, self.students, self.layout, self.device)
        dist.all_reduce(torch.zeros(3, dtype=torch.float64))  # the students' sums
        return {}

    def checkpointed(self) -> CheckpointedState:
        return CheckpointedState(engines={"model": None}, components={"sampler": None})


def teacher_rank_of(topology: Topology, student_rank: int) -> int:
    """The teacher rank serving `student_rank` (students are dealt round-robin over the teacher's ranks)."""
    teachers, students = topology.ranks(TEACHER), topology.ranks(Role.ACTOR)
    return teachers[students.index(student_rank) % len(teachers)]
