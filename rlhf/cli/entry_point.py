"""What every job's entry point does around its own setup: console routing and preemption handling from the
first moment, the checks of outputs and resume paths that need no engine, the machine-dependent choices
(dtype, attention), the metrics logger, and `main` (flag parsing with usage errors as one line, exit 2).
Knows config roots only through their shared sub-configs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
import tempfile
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from rlhf.config.errors import UsageError, usage_errors_exit
from rlhf.config.flags import parse_config
from rlhf.config.shared_config import CheckpointConfig, LoggingConfig, replace_quietly
from rlhf.core.checkpointer import restarted_by_launcher
from rlhf.distributed.launch_env import LaunchEnv, read_launch_env
from rlhf.models.loading import resolve_attention
from rlhf.utils.checkpoint_files import check_resume_path
from rlhf.utils.console import route_library_output
from rlhf.utils.logging import MetricsLogger, WandbSettings, check_no_earlier_run
from rlhf.utils.preemption import PreemptionWatch

C = TypeVar("C")


def begin(logging: LoggingConfig, parse_warnings: Sequence[warnings.WarningMessage]
          ) -> tuple[LaunchEnv, PreemptionWatch]:
    """Route library output (each distinct library warning once on the console, everything in
    SAVE_PATH/logs), then from here on treat SIGTERM/SIGUSR1 as "checkpoint at the next step boundary and
    stop" (one during setup is remembered, not fatal), and show the warnings raised while parsing."""
    launch = read_launch_env()
    route_library_output(logging, launch.rank)
    preemption = PreemptionWatch()
    show_parse_warnings(parse_warnings, launch.rank)
    return launch, preemption


def show_parse_warnings(parse_warnings: Sequence[warnings.WarningMessage], rank: int) -> None:
    """The notes of the flags and the config's validation: once, from rank 0 (every rank parses the same
    flags), as `Category: message` (their location would be the config's generated `__init__`)."""
    if rank == 0:
        for w in parse_warnings:
            print(f"{w.category.__name__}: {w.message}", file=sys.stderr, flush=True)


def for_this_machine(cfg: C) -> C:
    """The config with what this machine decides: fp16 needs CUDA (DeepSpeed's loss scaling);
    flash_attention_2 without CUDA and flash-attn runs SDPA, with a warning."""
    m = cfg.model
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


def check_outputs(logging: LoggingConfig, checkpoint: CheckpointConfig, default_ckpt_path: str) -> None:
    """--save_path (and --ckpt_path when checkpoints are written) are writable; --load_checkpoint finds its
    directory; a fresh run refuses a --save_path holding an earlier run's metrics; --use_wandb finds its package.
    Every rank calls it."""
    if logging.use_wandb and importlib.util.find_spec("wandb") is None:
        raise UsageError("--use_wandb needs the wandb package: pip install wandb (or log with --use_tensorboard DIR)")
    check_writable("--save_path", logging.save_path)
    restarted = restarted_by_launcher()
    if checkpoint.load_checkpoint:
        check_resume_path(checkpoint.ckpt_path, explicit_path=checkpoint.ckpt_path != default_ckpt_path,
                          restarted=restarted)
    elif not restarted:
        check_no_earlier_run(logging.save_path)
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
                          dataclasses.asdict(cfg)) if log.use_wandb else None
    return MetricsLogger(log.save_path, log.use_tensorboard, total_steps, enabled=is_writer, wandb=wandb,
                         bar_desc=bar_desc, bar_metrics=bar_metrics)


def main_for(config_cls: type, run: Callable[[Any, Sequence[warnings.WarningMessage]], None], prog: str,
             argv: list[str] | None = None) -> None:
    """Parse the flags of `config_cls` and run. Flag and input mistakes exit 2 with one `error:` line from
    rank 0 (see `rlhf.config.errors`); failures after torch.distributed is initialised keep their traceback."""
    with usage_errors_exit(started=dist.is_initialized):
        with warnings.catch_warnings(record=True) as parse_warnings:
            warnings.simplefilter("default")
            cfg = parse_config(config_cls, argv, prog=prog)
        run(cfg, parse_warnings)
