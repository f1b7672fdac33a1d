"""Throughput of every job: tokens per second, TFLOP/s and MFU, per step and per stage.

Every model a role builds (trained or frozen) counts the tokens of each forward it runs (`count_work`, a forward
hook): a forward under autograd is a training one (forward and backward: 6N + 12·L·d·T FLOPs per token), one
without is forward-only (2N + 4·L·d·T), with N the parameters that multiply each token's activations (every
weight but the input embedding table; the output projection counts once even when tied), L the layers, d the
hidden size and T the sequence length (PaLM's model-FLOPs convention: no causal halving, recomputation under
gradient checkpointing not counted). Generation by the rollout engine is counted by the step
(`count_generated`): 2N per prompt and generated token. The work is filed under the stage the rank is in
(`rlhf.utils.watchdog`: generation, experience, train, ...). `Throughput.metrics` turns one step's work and
stage times into metrics: `perf/tokens_per_s` (trained tokens over the world), `perf/tflops` (per rank, mean
over ranks), `perf/mfu` (against the device's dense bf16 peak, `--peak_tflops`, or none on a CPU without it),
and per stage `perf/{stage}_tflops`, `perf/generated_tokens_per_s`. `MemoryPeaks` measures each stage's peak
memory per rank, logged as `perf/memory_peak_gb_<stage>` beside the memory plan's `perf/memory_estimate_gb_<stage>`.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import warnings
from collections import defaultdict

import torch
import torch.distributed as dist

from rlhf.utils import watchdog

PEAK_BF16_TFLOPS = {  # dense bf16 tensor-core peaks from the vendors' data sheets (SXM parts where both exist)
    "H200": 989.0, "H100": 989.0, "H800": 989.0, "GH200": 989.0, "B200": 2250.0, "A100": 312.0, "A800": 312.0,
    "L40S": 362.0, "L40": 181.0, "L4": 121.0, "A10": 125.0, "A6000": 155.0, "4090": 165.0, "MI300X": 1307.0,
}


def device_peak_tflops(device: torch.device, override: float | None) -> tuple[float | None, str]:
    """(peak TFLOP/s of one device, where it comes from): `override` (--peak_tflops), else the table entry whose
    name the CUDA device's name contains, else None (a CPU, an unlisted GPU)."""
    if override:
        return override, "--peak_tflops"
    if device.type != "cuda":
        return None, f"no peak for {device.type}: pass --peak_tflops for MFU"
    name = torch.cuda.get_device_name(device)
    for key, peak in sorted(PEAK_BF16_TFLOPS.items(), key=lambda kv: -len(kv[0])):
        if key in name:
            return peak, f"{name}, dense bf16"
    return None, f"{name} is not in the peak table: pass --peak_tflops for MFU"


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What FLOPs per token need of a model: N (see the module docstring), layers, hidden size."""

    params: int
    layers: int
    hidden: int

    @staticmethod
    def of(module: torch.nn.Module) -> ModelShape:
        """From a (possibly ZeRO-3-partitioned, possibly LoRA-wrapped) HF model: `ds_numel` is a partitioned
        parameter's full size."""
        base = module.get_base_model() if hasattr(module, "get_base_model") else module
        config = base.config
        embedding = base.get_input_embeddings().weight
        params = sum(getattr(p, "ds_numel", p.numel()) for p in base.parameters() if p is not embedding)
        output = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
        if output is not None and output.weight is embedding:  # tied: the output projection still computes
            params += getattr(embedding, "ds_numel", embedding.numel())
        return ModelShape(params, config.num_hidden_layers, config.hidden_size)

    def flops(self, lengths: torch.Tensor, training: bool) -> float:
        """FLOPs of a forward (and backward when `training`) over sequences of these lengths: a token of a
        sequence of length s costs 6N + 12·L·d·s (forward only: 2N + 4·L·d·s)."""
        n = lengths.double()
        dense, attention = (6.0, 12.0) if training else (2.0, 4.0)
        return float(dense * self.params * n.sum() + attention * self.layers * self.hidden * (n * n).sum())


class WorkCounter:
    """This rank's tokens and FLOPs since the last `pop`, by stage; trained tokens and generated ones apart."""

    def __init__(self) -> None:
        self.flops: dict[str, float] = defaultdict(float)
        self.trained_tokens = 0.0
        self.generated_tokens = 0.0
        self.forwards: list[tuple] = []  # counted at `pop`: reading their lengths would stall the host mid-step

    def add(self, flops: float, stage: str) -> None:
        self.flops[stage] += flops

    def add_forward(self, shape: ModelShape, stage: str, training: bool, ids: torch.Tensor, mask, position_ids
                    ) -> None:
        """A model forward's work, from its inputs (`sequence_lengths`), counted when the step's figures are
        popped rather than now: on CUDA the lengths live on the device."""
        self.forwards.append((shape, stage, training, ids, mask, position_ids))

    def pop(self) -> tuple[dict[str, float], float, float]:
        for shape, stage, training, ids, mask, position_ids in self.forwards:
            lengths = sequence_lengths(ids, mask, position_ids)
            self.flops[stage] += shape.flops(lengths, training)
            if training:
                self.trained_tokens += float(lengths.sum())
        self.forwards.clear()
        out = (dict(self.flops), self.trained_tokens, self.generated_tokens)
        self.flops.clear()
        self.trained_tokens = self.generated_tokens = 0.0
        return out


WORK = WorkCounter()
TOKENS_PER_S = "perf/tokens_per_s"
STAGES = ("generation", "experience", "train", "weight_sync", "step")
"""The stages reported one by one (`perf/<stage>_tflops`); any other stage's work is reported as `other`."""


def current_stage() -> str | None:
    """The stage of the training step the rank is in (generation, experience, train, ...; "step" between
    them), or None outside a step (setup, evaluation: not counted)."""
    stack = watchdog.current_stack()
    if stack[:1] != ("step",):
        return None
    return stack[1] if len(stack) > 1 else "step"


def sequence_lengths(ids: torch.Tensor, mask: torch.Tensor | None, position_ids: torch.Tensor | None
                     ) -> torch.Tensor:
    """The lengths of the sequences of a forward's input: each row's mask sum (padded rows), or the spans
    between position-id restarts (packed rows), or each row's width."""
    if isinstance(mask, torch.Tensor) and mask.shape == ids.shape:
        return mask.sum(-1).flatten()
    if isinstance(position_ids, torch.Tensor) and position_ids.shape == ids.shape:
        lengths = []
        for row in position_ids.reshape(-1, ids.shape[-1]):
            starts = (row == 0).nonzero().flatten().tolist() or [0]
            if starts[0] != 0:
                starts = [0, *starts]
            lengths += [b - a for a, b in zip(starts, [*starts[1:], row.numel()])]
        return torch.tensor(lengths)
    return torch.full((ids.numel() // ids.shape[-1],), ids.shape[-1])


def count_work(module: torch.nn.Module, name: str) -> torch.nn.Module:
    """Count every forward of `module` (the model `name`) inside a training step into `WORK` (a forward hook);
    returns `module`. A model whose shape cannot be read is not counted, with a warning."""
    try:
        shape = ModelShape.of(module)
    except (AttributeError, TypeError) as err:
        warnings.warn(f"throughput metrics do not count the {name}'s forwards: its shape cannot be read ({err})",
                      stacklevel=2)
        return module

    def hook(_module, args, kwargs, _output) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        stage = current_stage()
        if stage is None or not isinstance(ids, torch.Tensor) or ids.dim() == 0:
            return
        WORK.add_forward(shape, stage, torch.is_grad_enabled(), ids, kwargs.get("attention_mask"),
                         kwargs.get("position_ids"))

    module.register_forward_hook(hook, with_kwargs=True)
    return module


def count_generated(shape: ModelShape, lengths: torch.Tensor, generated_tokens: float) -> None:
    """The rollout engine's work for one call on this rank (inside a step): a forward of every sample's prompt
    and generated tokens (`lengths`: each sample's prompt + response length)."""
    stage = current_stage()
    if stage is not None:
        WORK.add(shape.flops(lengths, training=False), stage)
        WORK.generated_tokens += generated_tokens


def shape_of_pretrained(path: str, trust_remote_code: bool = False) -> ModelShape:
    """The `ModelShape` of the causal LM at `path`, built on the meta device (no weights read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=True)
    with torch.device("meta"):
        return ModelShape.of(AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code))


class MemoryPeaks:
    """This rank's measured peak memory per stage, above a baseline taken when it is built (after imports and
    process groups, before any model): CUDA's max_memory_allocated, or on CPU the resident set's high-water
    mark (VmHWM; reset through /proc/self/clear_refs). At every change of stage (a watchdog listener) the peak
    since the last change is filed under the stage left and the peak is reset: both high-water marks are kept
    by the allocator or the kernel, so nothing is polled and no stage goes unseen. `estimates`: the memory
    plan's bytes per stage for this rank (without its reserve), logged beside."""

    def __init__(self, device: torch.device, estimates: dict[str, int] | None = None) -> None:
        self.cuda = device.type == "cuda"
        self.device, self.estimates = device, estimates or {}
        self.step_peaks: dict[str, int] = {}  # since the last `pop`
        self.run_peaks: dict[str, int] = {}
        self._stage: str | None = None
        self._lock = threading.Lock()  # `file` runs on any thread that changes stage, and from `Throughput.metrics`
        self.measurable = self.cuda or _proc_memory_resettable()
        if not self.measurable:
            warnings.warn("no measured peak memory per stage: this system has no /proc/self/clear_refs to reset the "
                          "resident set's high-water mark (perf/memory_peak_gb_* are not logged)", stacklevel=2)
            return
        self.baseline = self._current()
        self._reset()
        watchdog.on_change(self.file)

    def _current(self) -> int:
        if self.cuda:
            return torch.cuda.memory_allocated(self.device)
        return _status_kib("VmRSS") * 1024

    def _peak(self) -> int:
        if self.cuda:
            return torch.cuda.max_memory_allocated(self.device)
        return _status_kib("VmHWM") * 1024

    def _reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current resident set (Linux >= 4.0)

    def file(self) -> None:
        """At a change of stage, the peak since the last one goes to the stage left."""
        if not self.measurable:
            return
        with self._lock:
            stage = current_stage()
            if stage == self._stage:
                return
            if self._stage is not None:
                used = max(0, self._peak() - self.baseline)
                for peaks in (self.step_peaks, self.run_peaks):
                    peaks[self._stage] = max(peaks.get(self._stage, 0), used)
            self._reset()
            self._stage = stage

    def pop(self) -> dict[str, int]:
        out, self.step_peaks = self.step_peaks, {}
        return out

    def stop(self) -> None:
        if self.measurable:
            watchdog.off_change(self.file)

    def table(self) -> dict[str, dict[str, int]]:
        """stage -> {"measured": peak bytes over the run, "estimated": the plan's bytes} for this rank."""
        return {s: {"measured": self.run_peaks.get(s, 0), "estimated": self.estimates.get(s, 0)}
                for s in STAGES[:-1] if s in self.run_peaks or s in self.estimates}


def _proc_memory_resettable() -> bool:
    """Whether this (Linux) system lets a process read its resident set and reset its high-water mark."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_kib("VmHWM") > 0
    except (OSError, RuntimeError):
        return False


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def memory_metrics(memory: MemoryPeaks, world: int) -> dict[str, float]:
    """perf/memory_peak_gb_<stage> (measured) and perf/memory_estimate_gb_<stage> (planned), each the largest over the
    ranks, for the stages of `STAGES` but "step". Every rank calls it (one all-reduce with MAX over the world)."""
    stages = STAGES[:-1]
    peaks = memory.pop() if memory.measurable else {}
    local = torch.tensor([float(peaks.get(s, -1)) for s in stages]
                         + [float(memory.estimates.get(s, -1)) for s in stages], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(local, op=dist.ReduceOp.MAX)
    values = local.tolist()
    out = {f"perf/memory_peak_gb_{s}": v / 2**30 for s, v in zip(stages, values) if v >= 0}
    out.update({f"perf/memory_estimate_gb_{s}": v / 2**30 for s, v in zip(stages, values[len(stages):]) if v >= 0})
    return out


def gather_memory_table(memory: MemoryPeaks, rank: int, path: str | None) -> list[str]:
    """Every rank's measured and estimated peak per stage, written as JSON to `path` by rank 0 (None: not
    written); returns the table's lines on rank 0 (elsewhere []). Every rank calls it (an all-gather)."""
    memory.stop()
    tables = [memory.table()]
    if dist.is_initialized() and dist.get_world_size() > 1:
        tables = [None] * dist.get_world_size()
        dist.all_gather_object(tables, memory.table())
    if rank != 0:
        return []
    if path is not None:
        with open(path, "w") as f:
            json.dump({str(r): t for r, t in enumerate(tables)}, f, indent=1)
    lines = ["memory: measured peak vs planned, GiB per rank and stage (" +
             ("CUDA max_memory_allocated" if memory.cuda else "resident-set growth since start-up") + ")"]
    for r, table in enumerate(tables):
        cells = [f"{s} {v['measured'] / 2**30:.3f}/{v['estimated'] / 2**30:.3f}" for s, v in table.items()]
        lines.append(f"  rank {r}: " + ", ".join(cells))
    return lines


class Throughput:
    """Per-step throughput metrics from `WORK` and the step's stage times (`time/<stage>`), and the measured
    peak memory of each stage beside the plan's (`memory`, None: not measured). `peak`: one device's TFLOP/s
    (None: no MFU). Every rank calls `metrics` (all-reduces over the world)."""

    def __init__(self, peak: float | None, memory: MemoryPeaks | None = None) -> None:
        self.peak = peak
        self.memory = memory
        self.history: list[dict[str, float]] = []  # each step's perf/* and time/* (for `summary`)

    def metrics(self, times: dict[str, float]) -> dict[str, float]:
        flops, trained, generated = WORK.pop()
        other = sum(v for k, v in flops.items() if k not in STAGES)
        world = dist.get_world_size() if dist.is_initialized() else 1
        # the same layout on every rank (ranks of other roles run other stages): a collective of one shape
        local = torch.tensor([trained, generated, sum(flops.values()), *(flops.get(s, 0.0) for s in STAGES), other],
                             dtype=torch.float64)
        if world > 1:
            dist.all_reduce(local)
        trained, generated, total, *by_stage = local.tolist()
        stages = (*STAGES, "other")
        step_s = times.get("time/step", 0.0)
        out: dict[str, float] = {}
        if step_s > 0:
            out[TOKENS_PER_S] = trained / step_s
            out["perf/tflops"] = total / world / step_s / 1e12
            if self.peak:
                out["perf/mfu"] = out["perf/tflops"] / self.peak
        for stage, stage_flops in zip(stages, by_stage):
            seconds = times.get(f"time/{stage}", 0.0)
            if seconds > 0 and stage_flops > 0:
                out[f"perf/{stage}_tflops"] = stage_flops / world / seconds / 1e12
        if generated and times.get("time/generation", 0.0) > 0:
            out["perf/generated_tokens_per_s"] = generated / times["time/generation"]
        if self.memory is not None:
            self.memory.file()  # the step's last stage ended (the loop left it before logging)
            out.update(memory_metrics(self.memory, world))
        self.history.append({**{k: v for k, v in times.items() if k.startswith("time/")}, **out})
        return out

    def summary(self) -> str:
        """The `--perf` lines: every perf/* and time/* metric averaged over the steps after the first (its
        start-up costs are not throughput), or over the one step there was."""
        rows = self.history[1:] or self.history
        if not rows:
            return "perf: no steps ran"
        keys = sorted({k for row in rows for k in row})
        means = {k: sum(row.get(k, 0.0) for row in rows) / len(rows) for k in keys}
        lines = [f"perf: means over {len(rows)} step(s)" + (" after the first" if len(self.history) > 1 else "")]
        lines += [f"  {k:<32} {v:.4g}" for k, v in means.items()]
        return "\n".join(lines)
