"""One optimizer step over a rank's micro-batches, for any loss: every loss is a token (or sequence) sum
divided by the count over the whole global batch, so DP ranks x micro-batches add up to the global mean
whatever the split. The step checks each term for non-finite values before the update (see
`DeepSpeedModel.step`) and returns this rank's share of each term. Nothing is read back to the host before the
step's last micro-batch (on CUDA each read would stall the host until the device catches up).

Knows the trainable-model wrapper and process groups; nothing about what the loss means.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch
import torch.distributed as dist

from rlhf.engines.deepspeed_engine import DeepSpeedModel, first_flagged, nonfinite_flags

M = TypeVar("M")


@dataclass
class MicroLoss:
    """One micro-batch's contribution to the optimizer step's loss.

    `loss`: the scalar to back-propagate, already divided by the global count. `terms`: named scalars to log
    (this rank's share; summed over the step's micro-batches) and to check for non-finite values, in the order
    a failure is reported. `checked`: scalars only checked (e.g. an auxiliary loss folded into `loss`).
    """

    loss: torch.Tensor
    terms: dict[str, torch.Tensor] = field(default_factory=dict)
    checked: dict[str, torch.Tensor | None] = field(default_factory=dict)


@dataclass
class StepResult:
    """What one optimizer step did: whether the update was applied, and this rank's summed terms."""

    applied: bool
    terms: dict[str, float]


def global_counts(local: Sequence[float], group: dist.ProcessGroup, ring_size: int = 1) -> list[float]:
    """Counts (tokens, sequences, ...) summed over `group`, divided by the ring size (the ranks of a ring hold
    the same samples) and floored at 1 so an empty batch divides by 1. Collective over `group`."""
    t = torch.tensor(list(local), dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return [max(v / ring_size, 1.0) for v in t.tolist()]


def optimizer_step(model: DeepSpeedModel, micro_batches: Sequence[M],
                   loss_fn: Callable[[M], MicroLoss]) -> StepResult:
    """Forward/backward every micro-batch through `loss_fn`, then one optimizer step (DeepSpeed steps at the
    last micro-batch). Collective over the model's DP group at the boundary."""
    model.train()
    sums: dict[str, torch.Tensor] = {}  # float64 on the device: the same sums as Python floats, read once
    checks = []  # each micro-batch's non-finite flags, read at the boundary (`first_flagged`)
    applied = False
    last = len(micro_batches) - 1
    for i, micro in enumerate(micro_batches):
        out = loss_fn(micro)
        for name, value in out.terms.items():
            v = value.detach().double()
            sums[name] = sums[name] + v if name in sums else v
        checks.append(nonfinite_flags({**out.terms, **out.checked, "loss": out.loss}))
        model.backward(out.loss, last_micro_batch=i == last)
        # the first non-finite term of this optimizer step on this rank; DeepSpeedModel.step reads it at the boundary
        applied = model.step(first_flagged(checks) if i == last else None)
    return StepResult(applied, {name: float(v) for name, v in sums.items()})


def step_metrics(model: DeepSpeedModel, result: StepResult, prefix: str = "", with_lr: bool = True
                 ) -> dict[str, float]:
    """The step's metrics: its terms, grad norm and LR, and `nonfinite_skipped` (1 for a skipped step, whose
    terms are then not reported; 0 otherwise, when --max_nonfinite_steps allows skipping). `prefix` names the
    role's norm and counter (e.g. "critic_")."""
    lr = {"lr": model.learning_rate()} if with_lr else {}
    if not result.applied:
        return {f"{prefix}nonfinite_skipped": 1.0, **lr}
    stats = {**result.terms, f"{prefix}grad_norm": model.grad_norm(), **lr}
    if model.max_nonfinite_steps:
        stats[f"{prefix}nonfinite_skipped"] = 0.0
    return stats
