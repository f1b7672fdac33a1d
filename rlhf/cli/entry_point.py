"""`main` of every job's CLI module: flag parsing with usage errors as one line (exit 2), then the job's run
(`rlhf.core.run.run_job` for the training jobs).
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from rlhf.config.errors import usage_errors_exit
from rlhf.config.flags import parse_config


def main_for(config_cls: type, run: Callable[[Any, Sequence[warnings.WarningMessage]], None], prog: str,
             argv: list[str] | None = None) -> None:
    """Parse the flags of `config_cls` and run. Flag and input mistakes exit 2 with one `error:` line from
    rank 0 (see `rlhf.config.errors`); failures after torch.distributed is initialised keep their traceback."""
    with usage_errors_exit(started=distributed_started):
        with warnings.catch_warnings(record=True) as parse_warnings:
            warnings.simplefilter("default")
            cfg = parse_config(config_cls, argv, prog=prog)
        run(cfg, parse_warnings)


def distributed_started() -> bool:
    """Whether torch.distributed is initialised, without importing torch (a refused command never does)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def deferred(module: str) -> Callable[[Any, Sequence[warnings.WarningMessage]], None]:
    """The `run` of job module `module`, imported when called: after the flags have parsed, so a refused command
    answers before torch's and the engines' libraries load (transformers, DeepSpeed, vLLM: seconds)."""

    def run(cfg: Any, parse_warnings: Sequence[warnings.WarningMessage]) -> None:
        importlib.import_module(module).run(cfg, parse_warnings)

    return run
