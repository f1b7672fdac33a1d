"""A peer rank that dies (killed, out of memory) breaks the collective this rank is in: gloo raises `RuntimeError:
[...pair.cc] Connection closed by peer` (or `reset by peer`), NCCL `... remote process exited`. `peer_lost_exit`
turns that into one line naming this rank and the stage it was in, exit status 1, instead of a traceback through
the collective's call; the launcher's own line names the rank that died first (`rlhf.cli.launch`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from rlhf.utils import watchdog

PEER_LOST_MARKERS = ("Connection closed by peer", "Connection reset by peer", "remote process exited")
"""In the message of the error a collective raises when a peer's connection ends (gloo, gloo, NCCL)."""


def peer_lost(err: BaseException) -> bool:
    return isinstance(err, RuntimeError) and any(marker in str(err) for marker in PEER_LOST_MARKERS)


def peer_lost_line(rank: str, err: BaseException) -> str:
    detail = str(err).splitlines()[0] if str(err) else type(err).__name__
    return (f"\n[rank {rank}] a peer rank's connection closed while this rank was {watchdog.describe()}: that rank "
            f"died (killed, or out of memory; the launcher's line names it); the last complete checkpoint is "
            f"intact. The collective's error: {detail}")


@contextmanager
def peer_lost_exit() -> Iterator[None]:
    """Inside: a collective that fails because a peer died ends this process with `peer_lost_line` (exit 1)."""
    try:
        yield
    except RuntimeError as err:
        if not peer_lost(err):
            raise
        print(peer_lost_line(os.environ.get("RANK", "?"), err), file=sys.stderr, flush=True)
        raise SystemExit(1) from None
