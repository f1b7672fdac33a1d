"""The one assembly of a run, shared by every job (RL, supervised, preference, distillation, batch inference):
console routing and preemption handling from the first moment, the checks of outputs and resume paths that need
no engine, the machine-dependent choices (dtype, attention), distributed initialisation, the watchdog, the
topology, the seed, the metrics logger, the checkpointer and the loop. A job gives its `JobParts` (its checks and
inputs, its rank plan, its description, and how to build its `Job`); `run_job` does the rest (batch inference,
which writes chunks instead of steps, shares `start`). Knows config roots
only through their shared sub-configs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import sys
import tempfile
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from rlhf.config.errors import UsageError
from rlhf.config.shared_config import DEEPCOMPILE_NEEDS_CUDA, CheckpointConfig, LoggingConfig, replace_quietly
from rlhf.core.checkpointer import Checkpointer, restarted_by_launcher
from rlhf.core.loop import Job, Loop
from rlhf.core.run_summary import read_rows, summary_block
from rlhf.core.throughput import (
    TOKENS_PER_S,
    MemoryPeaks,
    Throughput,
    device_peak_tflops,
    gather_memory_table,
)
from rlhf.distributed.launch_env import LaunchEnv, finish_distributed, init_distributed, read_launch_env
from rlhf.distributed.topology import Role, Topology
from rlhf.engines.deepspeed_compat import install_subgroup_patches
from rlhf.models.loading import resolve_attention
from rlhf.utils import watchdog
from rlhf.utils.checkpoint_files import check_resumable, check_resume_path
from rlhf.utils.console import route_library_output
from rlhf.utils.curves import plot_runs
from rlhf.utils.logging import MetricsLogger, WandbSettings, check_no_earlier_run
from rlhf.utils.preemption import PreemptionWatch
from rlhf.utils.seeding import seed_everything
from rlhf.utils.watchdog import Watchdog

C = TypeVar("C")


def begin(logging: LoggingConfig) -> tuple[LaunchEnv, PreemptionWatch]:
    """Route library output (each distinct library warning once on the console, the notices that ask nothing of
    the user in one line, everything in SAVE_PATH/logs), then from here on treat SIGTERM/SIGUSR1 as "checkpoint at
    the next step boundary and stop" (one during setup is remembered, not fatal)."""
    launch = read_launch_env()
    route_library_output(logging, launch.rank)
    return launch, PreemptionWatch()


def show_parse_warnings(parse_warnings: Sequence[warnings.WarningMessage], rank: int) -> None:
    """The notes of the flags and the config's validation: once, from rank 0 (every rank parses the same
    flags), as `Category: message` (their location would be the config's generated `__init__`)."""
    if rank == 0:
        for w in parse_warnings:
            print(f"{w.category.__name__}: {w.message}", file=sys.stderr, flush=True)


def for_this_machine(cfg: C) -> C:
    """The config with what this machine decides: fp16 and --deepcompile need CUDA (DeepSpeed's loss scaling, its
    DeepCompile runtime);
    flash_attention_2 without CUDA and flash-attn runs SDPA, with a warning."""
    m = cfg.model
    if getattr(getattr(cfg, "engine", None), "deepcompile", False) and not torch.cuda.is_available():
        raise UsageError(DEEPCOMPILE_NEEDS_CUDA)
    if m.param_dtype == "fp16" and not torch.cuda.is_available():
        raise UsageError("--param_dtype fp16 needs CUDA (DeepSpeed's fp16 loss scaling); on CPU pass "
                         "--param_dtype bf16 or --param_dtype fp32")
    flag = "--flash_attn" if m.flash_attn else f"--attn_implementation {m.attn_implementation}"
    if m.attn == "flash_attention_2" and m.attn_implementation == "flash_attention_2" and not m.flash_attn:
        flag += " (the default)"
    attn = resolve_attention(m.attn, flag)
    if attn == m.attn:
        return cfg
    return replace_quietly(cfg, model=replace_quietly(m, attn_implementation=attn, flash_attn=False))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model")
"""The files a model directory's tokenizer is read from (whichever it has)."""


def tokenizer_fingerprint(path: str) -> dict[str, str]:
    """sha256 of each tokenizer file in model directory `path` (`TOKENIZER_FILES`), by file name."""
    import hashlib

    prints = {}
    for name in TOKENIZER_FILES:
        file = os.path.join(path, name)
        if os.path.isfile(file):
            with open(file, "rb") as f:
                prints[name] = hashlib.sha256(f.read()).hexdigest()
    return prints


def state_flags(cfg: Any) -> dict[str, Any]:
    """The flags whose change makes a checkpoint's engine states mean something else (their dtype, which
    weights train): a resume must keep them. --zero_stage and --ds_tensor_parallel_size may change: the states
    move (`rlhf.engines.portable_state`), as they do to another world size or placement."""
    flags = {}
    model = getattr(cfg, "model", None)
    if model is not None:
        flags["--param_dtype"] = model.param_dtype
        lora = model.lora
        flags["--lora_rank"] = lora.lora_rank
        if lora.lora_rank:
            flags.update({"--lora_alpha": lora.lora_alpha, "--target_modules": " ".join(lora.target_modules)})
    return flags


def run_identity(cfg: Any) -> dict:
    """What a training run is, recorded in its checkpoints: the job (`python -m rlhf.cli.<job>`, from the config
    root), --pretrain with its weights' fingerprint (`rlhf.models.lora.weights_fingerprint`: a few rows a
    tensor, so a model of the same shapes with other weights differs) and its tokenizer files'
    (`tokenizer_fingerprint`), and the flags that shape the engine states (`state_flags`). A reward model,
    reference or data may change between a run and its resume."""
    from rlhf.config.jobs import job_of
    from rlhf.models.lora import weights_fingerprint

    entry = job_of(cfg)
    job = entry.name if entry is not None else type(cfg).__name__
    pretrain = cfg.model.pretrain
    local = bool(pretrain) and os.path.isdir(pretrain)
    return {"job": job, "pretrain": pretrain,
            "pretrain_fingerprint": weights_fingerprint(pretrain) if local else None,
            "tokenizer_fingerprint": tokenizer_fingerprint(pretrain) if local else None,
            "state_flags": state_flags(cfg)}


def check_outputs(logging: LoggingConfig, checkpoint: CheckpointConfig, default_ckpt_path: str,
                  identity: dict | None = None) -> None:
    """--save_path (and --ckpt_path when checkpoints are written) are writable; --load_checkpoint finds its
    directory and an intact checkpoint this run can resume (if any exist); a fresh run refuses a
    --save_path holding an earlier run's metrics; --use_wandb finds its package. Every rank calls it."""
    if logging.use_wandb and importlib.util.find_spec("wandb") is None:
        raise UsageError("--use_wandb needs the wandb package: pip install wandb (or log with --use_tensorboard DIR)")
    check_writable("--save_path", logging.save_path)
    restarted = restarted_by_launcher()
    if checkpoint.load_checkpoint:
        check_resume_path(checkpoint.ckpt_path, explicit_path=checkpoint.ckpt_path != default_ckpt_path,
                          restarted=restarted)
    elif not restarted:
        check_no_earlier_run(logging.save_path)
    if checkpoint.load_checkpoint or restarted:  # what the resume will find, before any engine starts
        check_resumable(checkpoint.ckpt_path, why="torchrun restart" if restarted else "--load_checkpoint",
                        identity=identity)
    if checkpoint.save_steps != -1:
        check_writable("--ckpt_path", checkpoint.ckpt_path)


def check_writable(flag: str, path: str) -> None:
    """Write a temporary file in directory `path` (or, while it does not exist, a temporary directory in its
    nearest existing parent, so a failed run leaves nothing behind): an unwritable output fails now, not
    after the first training step. Every rank calls it (a node may lack the mount)."""
    existing = os.path.abspath(path)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    try:
        if not os.path.isdir(existing):
            raise NotADirectoryError(20, f"{existing} is not a directory")
        if existing == os.path.abspath(path):
            with tempfile.NamedTemporaryFile(dir=existing, prefix=".write_test"):
                pass
        else:
            os.rmdir(tempfile.mkdtemp(dir=existing, prefix=".write_test"))
    except OSError as err:
        raise UsageError(f"{flag} {path} is not writable ({err.strerror or err}); choose a directory this "
                         "user can write") from err


def metrics_logger(cfg: Any, total_steps: int, is_writer: bool, bar_desc: str,
                   bar_metrics: dict[str, str]) -> MetricsLogger:
    """metrics.jsonl under --save_path, TensorBoard and wandb as configured (writer rank only)."""
    log = cfg.logging
    wandb = WandbSettings(log.use_wandb, log.wandb_project, log.wandb_group, log.wandb_run_name,
                          dataclasses.asdict(cfg), entity=log.wandb_org) if log.use_wandb else None
    return MetricsLogger(log.save_path, log.use_tensorboard, total_steps, enabled=is_writer, wandb=wandb,
                         bar_desc=bar_desc, bar_metrics=bar_metrics)



@dataclass(frozen=True)
class Started:
    """A run after its checks, with its process groups: what a job builds its step from. `cfg`: the config as
    this machine runs it (demo defaults and machine choices applied); `demo`: no --pretrain was given."""

    cfg: Any
    launch: LaunchEnv
    preemption: PreemptionWatch
    topology: Topology
    device: torch.device
    demo: bool
    started_at: float = field(default_factory=time.time)
    identity: dict | None = None  # a training run's job and --pretrain (`run_identity`), recorded in checkpoints

    @property
    def is_writer(self) -> bool:
        return self.launch.rank == 0


@dataclass
class Assembled:
    """A job, built on this rank: its step (`trainer`), the number of steps, how often it evaluates (None:
    never), the checkpoint interval, what to do once resumed (e.g. push the weights to the rollout engine) and
    how to save the final model (collective; called when the last step is done)."""

    trainer: Job
    steps: int
    eval_every: int | None
    save_steps: int
    save: Callable[[], None]
    after_resume: Callable[[], None] = field(default=lambda: None)


class RunParts(ABC):
    """A job's part of a run's start; one instance per run (it may keep what `prepare` read). `demo_line`:
    shown without --pretrain."""

    demo_line: str

    @abstractmethod
    def prepare(self, cfg: Any, launch: LaunchEnv) -> dict[Role, tuple[int, ...]]:
        """The job's checks of flags, model files and inputs, and the inputs it reads, before any engine or
        process group starts; returns the rank plan (role -> ranks)."""

    def topology(self, cfg: Any, plan: dict[Role, tuple[int, ...]]) -> Topology:
        return Topology(plan, ring_size=cfg.engine.ring_attn_size, hpz_size=cfg.engine.hpz_size,
                        tp_size=cfg.engine.ds_tensor_parallel_size)


class JobParts(RunParts):
    """A training job's parts of a run: the start's, its description and its step. `name`: the progress bar's
    (`{name} steps`); `bar`: progress-bar label -> metric; `summary`: metrics the end-of-run summary and plots
    show after the bar's (held-out ones are always shown), then every metric the rows hold whose name starts with
    one of `summary_prefixes` (PPO: the reward function's or agent's own `reward_extra/` logs)."""

    name: str
    bar: dict[str, str]
    summary: tuple[str, ...] = ()
    summary_prefixes: tuple[str, ...] = ()

    def describe(self, run: Started) -> list[str]:
        """Lines rank 0 prints before the engines are built."""
        return []

    @abstractmethod
    def build(self, run: Started) -> Assembled:
        """This rank's engines and step (every rank calls it, in the same order)."""


def start(parts: RunParts, cfg: Any, parse_warnings: Sequence[warnings.WarningMessage], *,
          logging: LoggingConfig | None = None, trains: bool = True) -> Started:
    """Everything before a job builds its engines: console routing (logs beside `logging.save_path`, default
    the config's) and preemption handling, a training job's outputs (`trains`: --save_path, --ckpt_path,
    --load_checkpoint; checked first, so their error is the first line shown), the flags' notes, the config as
    this machine runs it, the job's own checks and inputs, the process groups, the watchdog and the topology."""
    started_at = process_start_time()
    launch, preemption = begin(logging or cfg.logging)
    demo = cfg.model.pretrain is None
    cfg = cfg.with_demo_defaults()
    # first: an unwritable output or a missing resume path is the first line a user reads (a dry run writes none)
    identity = run_identity(cfg) if trains else None
    if trains and not cfg.dry_run:
        check_outputs(cfg.logging, cfg.checkpoint, default_ckpt_path(cfg), identity)
    show_parse_warnings(parse_warnings, launch.rank)
    cfg = for_this_machine(cfg)
    plan = parts.prepare(cfg, launch)
    if cfg.dry_run:
        print_memory_plan(cfg, plan, launch)
        sys.exit(0)
    device = init_distributed(launch, cfg.dist_timeout)
    Watchdog(launch.rank, cfg.watchdog_interval).start()  # prints where this rank is stuck, if it is
    return Started(cfg, launch, preemption, parts.topology(cfg, plan), device, demo, started_at, identity)


def process_start_time() -> float:
    """When this process started (wall clock; its imports count toward a run's time), or now where /proc
    cannot tell."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time, clock ticks after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()


def print_memory_plan(cfg: Any, plan: dict[Role, tuple[int, ...]], launch: LaunchEnv) -> None:
    """--dry_run: the rank plan and the memory estimate per rank and stage, from rank 0 (configs only, no
    weights; `rlhf.planning`)."""
    from rlhf.planning.job_memory import job_memory
    from rlhf.planning.report import report

    if launch.rank == 0:
        print(report(cfg, job_memory(cfg, plan), plan, launch.world_size), flush=True)


def planned_stage_bytes(cfg: Any, plan: dict[Role, tuple[int, ...]], launch: LaunchEnv) -> dict[str, int]:
    """This rank's planned peak bytes per stage (the reserve left out), logged beside the measured peaks; {} for
    a model the plan cannot read, with a warning."""
    from rlhf.planning.job_memory import job_memory
    from rlhf.planning.report import stage_estimates

    try:
        return stage_estimates(job_memory(cfg, plan), launch.world_size, launch.rank)
    except UsageError as err:
        warnings.warn(f"no memory estimate beside the measured peaks: {err}", stacklevel=2)
        return {}


def default_ckpt_path(cfg: Any) -> str:
    """The job's default --ckpt_path (a resume from an explicitly given path must find it)."""
    return type(cfg)().checkpoint.ckpt_path


def run_job(parts: JobParts, cfg: Any, parse_warnings: Sequence[warnings.WarningMessage] = ()) -> None:
    """Train the job of `parts` with `cfg` (its root config) on every rank: `start`, the description, the seed,
    the job's engines and step, the metrics logger, the checkpointer (resuming with --load_checkpoint), the
    loop, and the final model."""
    run = start(parts, cfg, parse_warnings)
    cfg, launch = run.cfg, run.launch
    if run.is_writer:
        for line in ([parts.demo_line] if run.demo else []) + parts.describe(run):
            print(line, flush=True)
    if run.topology.has_subgroups:
        install_subgroup_patches()
    seed_everything(cfg.seed + launch.rank, cfg.full_determinism)
    memory = MemoryPeaks(run.device, planned_stage_bytes(cfg, run.topology.plan, launch))
    with watchdog.stage("build"):  # models, engines and data: a watchdog line during a slow start names it
        job = parts.build(run)
    peak, source = device_peak_tflops(run.device, cfg.logging.peak_tflops)
    if run.is_writer:
        print("throughput: perf/tokens_per_s, perf/tflops per rank, " + (f"perf/mfu against {peak:g} TFLOP/s "
              f"({source})" if peak else f"no perf/mfu ({source})"), flush=True)
    logger = metrics_logger(cfg, job.steps, run.is_writer, f"{parts.name} steps", {**parts.bar, "tok/s": TOKENS_PER_S})
    checkpointer = Checkpointer(cfg.checkpoint, default_ckpt_path=default_ckpt_path(cfg),
                                rank=launch.rank, world_size=launch.world_size, logger=logger, identity=run.identity)
    throughput = Throughput(peak, memory)
    loop = Loop(job.steps, cfg.logging.logging_steps, job.save_steps, job.eval_every, logger, checkpointer,
                launch.rank, throughput)
    with watchdog.stage("resume"):
        begin_step = loop.resume(job.trainer)
        job.after_resume()
    try:
        if loop.fit(job.trainer, begin_step, run.preemption):
            job.save()
    finally:
        logger.close()
    peaks_path = os.path.join(cfg.logging.save_path, "memory_peaks.json")
    table = gather_memory_table(memory, launch.rank, peaks_path)
    dist.barrier()
    finish_distributed()
    if run.is_writer:
        print_summary(parts, cfg, run.started_at, begin_step, peaks_path)
    if cfg.logging.perf and run.is_writer:
        print(throughput.summary(), flush=True)
        print("\n".join(table), flush=True)


def print_summary(parts: JobParts, cfg: Any, started_at: float, begin_step: int, peaks_path: str) -> None:
    """Rank 0, at the end of a run: its plots (SAVE_PATH/plots, unless --no_plots) from metrics.jsonl, then the
    summary block."""
    save_path = cfg.logging.save_path
    metrics_path = os.path.join(save_path, "metrics.jsonl")
    rows = read_rows(metrics_path) if os.path.isfile(metrics_path) else []
    extras = sorted({k for row in rows for k in row if k.startswith(parts.summary_prefixes)}) \
        if parts.summary_prefixes else []
    keys = (*parts.bar.values(), *parts.summary, *extras)
    plots = "" if cfg.logging.no_plots else os.path.join(save_path, "plots")  # "": not listed as an output
    if rows and plots:
        plot_runs({os.path.basename(os.path.abspath(save_path)): rows}, plots, keys)
    memory = None
    if os.path.isfile(peaks_path):
        with open(peaks_path) as f:
            memory = json.load(f)
    model = os.path.join(save_path, "model")
    outputs = [("model", model if os.path.isdir(model) else
                save_path if os.path.isfile(os.path.join(save_path, "config.json")) else ""),
               ("metrics", metrics_path), ("TensorBoard", cfg.logging.use_tensorboard or ""), ("plots", plots),
               ("logs", os.path.join(save_path, "logs"))]
    lines = summary_block(rows, keys, name=parts.name, wall_s=time.time() - started_at, outputs=outputs,
                          memory=memory, resumed_after=begin_step)
    print("\n".join(lines), flush=True)
