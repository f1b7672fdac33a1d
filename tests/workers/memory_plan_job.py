"""`rlhf.cli.train_ppo` (or another job: the first argument names it) in a rank forked from the tests' preloaded
server, with glibc's mmap threshold fixed as benchmarks/memory_plan.py fixes it through MALLOC_MMAP_THRESHOLD_ for a
new interpreter: freed tensors of 64 KiB and more leave the resident set (a forked process has read the environment
long before, so the setting is made with `mallopt`)."""

from __future__ import annotations

import ctypes
import importlib
import sys

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


def main(argv: list[str]) -> None:
    threshold = int(argv[0])
    if not ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, threshold):
        sys.exit(f"mallopt(M_MMAP_THRESHOLD, {threshold}) failed")
    importlib.import_module(argv[1]).main(argv[2:])
