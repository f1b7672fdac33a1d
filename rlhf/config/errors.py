"""User-input errors and how the entry points report them: one `error: ...` line per problem, from
rank 0 only, exit status 2, no traceback and no argparse usage dump.

Under torchrun every rank parses the same flags and checks the same inputs, so without this each rank
would print the same message (argparse: its whole usage text), and the launcher's `ChildFailedError`
banner would bury it. This module does not know torch.distributed; the entry point says when its
engines have started.

What counts as a usage error (everything else keeps its traceback and a non-zero exit):
- a `UsageError`, wherever it is raised: the config validation (`rlhf.config.shared_config` and the job roots)
  raises it, and so may any check that names a flag and its fix;
- an argparse error (unknown or misspelt flag, bad value type), reported by `rlhf.config.flags`;
- a plain `ValueError` raised by this package's own code (the `raise` is in an `rlhf` module) before
  the engines start: the entry point's input checks (dataset files and rows, reward function files,
  world-size splits) run before torch.distributed is initialised, and their loaders stay plain
  `ValueError` because they are also called later, at training time.

A `ValueError` raised inside a library, and anything but a `UsageError` raised once the engines have
started, is not a usage error: those are bugs or environment problems, and their traceback is what
one needs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import NoReturn

USAGE_EXIT_CODE = 2
"""Exit status of a usage error (argparse's convention)."""

RANK0_GRACE_S = 60.0
"""How long another rank waits, before engines start, for rank 0 to report the same usage error.

torchrun stops every rank as soon as one exits, so a rank that exited at once could get rank 0 killed
before it prints. Rank 0 checks the same inputs and its exit ends the wait (torchrun stops this rank
silently); a rank still alive afterwards has met an error rank 0 did not (say, a file missing on one
node) and reports it itself, prefixed with its rank. Under srun without --kill-on-bad-exit every rank
reports after the wait.
"""


class UsageError(ValueError):
    """A mistake in the user's flags or inputs; the message names the flag (or file and row) and the fix."""


def launch_rank(environ: dict[str, str] | None = None) -> int:
    """This process's rank as set by the launcher (torchrun's RANK, srun's SLURM_PROCID), readable
    before torch.distributed starts; 0 for a plain single process."""
    env = os.environ if environ is None else environ
    value = env.get("RANK", env.get("SLURM_PROCID", "0"))
    return int(value) if value.isdigit() else 0


def exit_usage(problems: str | Iterable[str], every_rank: bool = False) -> NoReturn:
    """Print `error: <problem>` for each problem and exit with status 2. Rank 0 prints at once; other
    ranks print (prefixed with their rank) only when `every_rank`, or when still alive after
    `RANK0_GRACE_S`. Called by any rank; no collective."""
    rank = launch_rank()
    prefix = ""
    if rank != 0:
        if not every_rank:
            # torchrun ends this rank with SIGTERM once rank 0 has exited: let it (the preemption handler
            # would otherwise hold the signal for a step boundary that never comes, costing torchrun's
            # 30 s grace period).
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
            time.sleep(RANK0_GRACE_S)
        prefix = f"[rank {rank}] "
    for line in problems.splitlines() if isinstance(problems, str) else problems:
        print(f"error: {prefix}{line}", file=sys.stderr, flush=True)
    raise SystemExit(USAGE_EXIT_CODE)


def _raised_by_rlhf(err: BaseException) -> bool:
    """Whether the innermost frame of `err`'s traceback is in an `rlhf` module (not a library)."""
    tb = err.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return str(tb.tb_frame.f_globals.get("__name__", "")).split(".")[0] == "rlhf"


@contextlib.contextmanager
def usage_errors_exit(started: Callable[[], bool] = lambda: False) -> Iterator[None]:
    """Report usage errors raised inside the block with `exit_usage`; re-raise everything else.

    `started()` tells whether the engines have started (the entry point passes
    `torch.distributed.is_initialized`). Once they have, ranks may fail differently, so a
    `UsageError` is then printed at once by every rank that raises it.
    """
    try:
        yield
    except ValueError as err:
        is_started = started()
        if not isinstance(err, UsageError) and (is_started or not _raised_by_rlhf(err)):
            raise
        exit_usage(str(err), every_rank=is_started)
