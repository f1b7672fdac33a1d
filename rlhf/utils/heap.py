"""Keeps long-lived objects out of the cyclic garbage collector's full collections."""

from __future__ import annotations

import atexit
import gc

_unfreeze_at_exit = False


def freeze_heap() -> None:
    """Move every object alive now out of the cyclic garbage collector's reach (`gc.freeze()`): called once the
    libraries are imported, whose objects (millions) live until the process ends, so that every later full
    collection, the libraries' own (vLLM calls `gc.collect()` while loading its model and freezing its heap,
    DeepSpeed's ZeRO-3 while defragmenting) and Python's, skips them instead of walking them all (about 0.45 s
    each on a 2-core machine).

    The first call also unfreezes them at exit: an interpreter that finalizes normally (a failed run) then frees
    them as usual (frozen, nanobind-based libraries report each of their objects as leaked)."""
    global _unfreeze_at_exit
    gc.freeze()
    if not _unfreeze_at_exit:
        atexit.register(gc.unfreeze)
        _unfreeze_at_exit = True
