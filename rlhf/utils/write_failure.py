"""A checkpoint that could not be written (a full disk, a quota, an I/O error) ends the run with one line naming
the directory, the free space and the fix (`rlhf.utils.checkpoint_files.describe_write_failure` writes it), exit
status 1, not a traceback. Torch-free: the entry point imports it before the flags are parsed."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (full disk, quota, I/O error); the message names the directory."""


@contextlib.contextmanager
def write_failure_exit() -> Iterator[None]:
    """Inside: a `CheckpointWriteError` ends this process with its message as one `error:` line, exit status 1."""
    try:
        yield
    except CheckpointWriteError as err:
        print(f"\n[rank {os.environ.get('RANK', '?')}] error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
