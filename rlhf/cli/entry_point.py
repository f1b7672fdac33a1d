"""`main` of every job's CLI module: flag parsing with usage errors as one line (exit 2), then the job's run
(`rlhf.core.run.run_job` for the training jobs).
"""

from __future__ import annotations

import atexit
import gc
import importlib
import os
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from rlhf.config.errors import usage_errors_exit
from rlhf.config.flags import parse_config
from rlhf.distributed.peer_lost import peer_lost_exit
from rlhf.utils.heap import freeze_heap
from rlhf.utils.preload import preload_this_program
from rlhf.utils.write_failure import write_failure_exit


def main_for(config_cls: type, run: Callable[[Any, Sequence[warnings.WarningMessage]], None], prog: str,
             argv: list[str] | None = None) -> None:
    """Parse the flags of `config_cls` and run. Flag and input mistakes exit 2 with one `error:` line from
    rank 0 (see `rlhf.config.errors`); failures after torch.distributed is initialised keep their traceback,
    except a collective broken by a peer that died (`rlhf.distributed.peer_lost`) and a checkpoint that could
    not be written (`rlhf.utils.write_failure`): one line each.

    argv None means this call is the program (the flags are `sys.argv`): after the run returns, the process
    ends here (`end_program`). With an argv list it returns, for callers that run several jobs in one process.
    A program on a CPU build of torch restarts itself once its flags have parsed (a refused command answers
    first) with the libraries `rlhf.cli.launch` preloads, where they are missing (`rlhf.utils.preload`: plain
    torchrun and srun do not add them)."""
    with usage_errors_exit(started=distributed_started), peer_lost_exit(), write_failure_exit():
        with warnings.catch_warnings(record=True) as parse_warnings:
            warnings.simplefilter("default")
            cfg = parse_config(config_cls, argv, prog=prog)
        if argv is None:
            preload_this_program()
        run(cfg, parse_warnings)
    if argv is None:
        end_program(exit_status())


def exit_status() -> int:
    """130 after a run a Ctrl-C ended (with its checkpoint), else 0 (`rlhf.utils.preemption.exit_status`)."""
    preemption = sys.modules.get("rlhf.utils.preemption")
    return preemption.exit_status() if preemption is not None else 0


def end_program(status: int = 0) -> NoReturn:
    """End a program whose job returned, with exit status `status`, without the interpreter's finalization: on a
    process that has loaded torch, transformers, DeepSpeed and vLLM it spends seconds freeing millions of
    objects one by one (4-5 s per rank on a 2-core machine, more than a tiny job's training steps). What
    finalization does that matters is done first and in its order: the threads are joined as at shutdown, the
    atexit handlers run (the engines' shutdown and the process groups' teardown, logging's flush), the standard
    streams are flushed. `gc.freeze()` first: the collections those handlers run (vLLM's shutdown calls
    `gc.collect()`) then skip every object alive now instead of walking them all."""
    gc.freeze()
    threading._shutdown()  # what the interpreter calls first at exit: joins the non-daemon threads
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        if stream is not None:
            stream.flush()
    os._exit(status)


def distributed_started() -> bool:
    """Whether torch.distributed is initialised, without importing torch (a refused command never does)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def deferred(module: str) -> Callable[[Any, Sequence[warnings.WarningMessage]], None]:
    """The `run` of job module `module`, imported when called: after the flags have parsed, so a refused command
    answers before torch's and the engines' libraries load (transformers, DeepSpeed, vLLM: seconds). Once they
    are imported, their objects are frozen out of the garbage collector's walks (`rlhf.utils.heap.freeze_heap`)."""

    def run(cfg: Any, parse_warnings: Sequence[warnings.WarningMessage]) -> None:
        job = importlib.import_module(module)
        freeze_heap()
        job.run(cfg, parse_warnings)

    return run
