"""A frozen model (a distillation teacher, a DPO/KTO reference) for the trained model's ranks: colocated on
the same ranks (`FrozenModel`, optionally in host memory between phases) or on ranks of its own, where a
`FrozenService` answers each student rank's micro-batches point to point through its `FrozenLink`.

Both answer the same question for a micro-batch of right-padded token ids: the frozen model's per-token
output as a right-padded float32 tensor [B, T, *tail] (logits: tail = (V,); target log-probs: tail = ()).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from rlhf.core.metrics import reduce_metrics
from rlhf.core.state import CheckpointedState
from rlhf.distributed.topology import Role, Topology
from rlhf.engines.deepspeed_engine import DeepSpeedModel
from rlhf.models.layout import LaidOut, SequenceLayout
from rlhf.models.lm_logprobs import token_logprobs
from rlhf.trainers.supervised_trainer import MODEL
from rlhf.utils.timers import StageTimer

Answer = Callable[[torch.nn.Module, LaidOut], torch.Tensor]
"""(module, laid-out micro-batch) -> the padded float32 answer [B, T, *tail] (called under no_grad)."""


def padded_logits(module: torch.nn.Module, laid: LaidOut) -> torch.Tensor:
    """[B, T, V] float32 logits (a distillation teacher's answer)."""
    return laid.to_padded(module(**laid.kwargs).logits).float()


def padded_target_logprobs(module: torch.nn.Module, laid: LaidOut) -> torch.Tensor:
    """[B, T] float32: at position t, log p(token t + 1); the last column is padding (a reference's answer)."""
    return laid.to_padded(token_logprobs(module(**laid.kwargs).logits, laid.targets)).float()


class FrozenModel:
    """A frozen role colocated with the trained model: its answers computed here, its parameters optionally
    in host memory outside `begin`/`end` (`offload`)."""

    def __init__(self, model: DeepSpeedModel, layout: SequenceLayout, answer: Answer, device: torch.device,
                 offload: bool) -> None:
        self.model, self.layout, self.answer, self.device, self.offload = model, layout, answer, device, offload
        if offload:
            model.offload()

    def begin(self, num_micro_batches: int) -> None:
        if self.offload:
            self.model.reload(self.device)
        self.model.eval()

    @torch.no_grad()
    def request(self, ids_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
        return self.answer(self.model.engine, self.layout.lay_out(ids_BT.to(self.device), mask_BT.to(self.device)))

    def end(self) -> None:
        if self.offload:
            self.model.offload()


class FrozenLink:
    """A student rank's connection to its frozen role on other ranks (point to point, in the order
    `serve_frozen` answers: a phase's micro-batch count, then per micro-batch the batch shape, the token ids
    and the attention mask, answered with the float32 tensor [B, T, *tail])."""

    def __init__(self, server_rank: int, tail: Sequence[int], device: torch.device) -> None:
        self.server_rank, self.tail, self.device = server_rank, tuple(tail), device

    def begin(self, num_micro_batches: int) -> None:
        dist.send(torch.tensor([num_micro_batches], dtype=torch.int64), self.server_rank)

    def request(self, ids_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
        dist.send(torch.tensor(list(ids_BT.shape), dtype=torch.int64), self.server_rank)
        dist.send(ids_BT.cpu().to(torch.int64).contiguous(), self.server_rank)
        dist.send(mask_BT.cpu().to(torch.int64).contiguous(), self.server_rank)
        out = torch.empty(*ids_BT.shape, *self.tail, dtype=torch.float32)
        dist.recv(out, self.server_rank)
        return out.to(self.device)

    def end(self) -> None:
        """Nothing to release: the frozen model lives on its own ranks."""


Frozen = FrozenModel | FrozenLink


def serve_frozen(model: DeepSpeedModel, students: list[int], layout: SequenceLayout, answer: Answer,
                 device: torch.device) -> None:
    """One phase (a training step or an evaluation) on a frozen role's rank: read each student's micro-batch
    count, then answer round-robin, micro-batch i of every student before micro-batch i + 1 of any, so
    students that meet in a collective between micro-batches never wait on each other's answers."""
    counts = []
    for rank in students:
        n = torch.zeros(1, dtype=torch.int64)
        dist.recv(n, rank)
        counts.append(int(n))
    model.eval()
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
                out = answer(model.engine, layout.lay_out(ids.to(device), mask.to(device)))
            dist.send(out.float().cpu().contiguous(), rank)


def server_rank_of(topology: Topology, role: Role, student_rank: int) -> int:
    """The rank of `role` serving `student_rank` (the trained model's ranks are dealt round-robin over it)."""
    servers, students = topology.ranks(role), topology.ranks(MODEL)
    return servers[students.index(student_rank) % len(servers)]


class FrozenService:
    """The `Job` of a frozen role on its own ranks: each step (and evaluation) answers its students in one
    phase, then takes part in the world-wide collectives the students' step and evaluation end with, with
    nothing of its own: those the trainer it serves (`served`, a `SupervisedTrainer` class) declares, its metric
    table and its evaluation's `eval_sums`. Holds no checkpointed state."""

    def __init__(self, model: DeepSpeedModel, role: Role, topology: Topology, layout: SequenceLayout,
                 answer: Answer, device: torch.device, served: type, *, has_eval: bool) -> None:
        self.model, self.topology, self.layout, self.answer, self.device = model, topology, layout, answer, device
        self.metrics, self.eval_sums, self.has_eval = served.metrics, served.eval_sums, has_eval
        servers, students = topology.ranks(role), topology.ranks(MODEL)
        mine = servers.index(topology.rank)
        self.students = [r for i, r in enumerate(students) if i % len(servers) == mine]
        self.timer = StageTimer()

    def step(self, step: int) -> dict[str, float]:
        with self.timer.stage("train"):
            serve_frozen(self.model, self.students, self.layout, self.answer, self.device)
        return reduce_metrics({}, self.metrics, self.topology)

    def evaluate(self) -> dict[str, float]:
        if not self.has_eval:
            return {}
        serve_frozen(self.model, self.students, self.layout, self.answer, self.device)
        for n in self.eval_sums:
            dist.all_reduce(torch.zeros(n, dtype=torch.float64))
        return {}

    def checkpointed(self) -> CheckpointedState:
        return CheckpointedState(engines={"model": None}, components={"sampler": None})
