"""Run a function on N gloo ranks in fresh processes and collect what each returns."""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

import torch.multiprocessing as mp

from rlhf.cli.warm_start import TRAINING_RUN_MODULES, VLLM_ENGINE_MODULES
from rlhf.distributed.launch_env import PORT_IN_USE


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PRELOAD = ["torch", "torch.distributed", "transformers", "deepspeed", "rlhf.core.role_models", "tests.tiny_actor",
           # what a job imports later: vLLM's top level is lazy (its engine, config and CPU worker: 4-6 s a rank;
           # the product launcher's warm start imports the same), the plots' matplotlib, the RL job's own modules,
           # what a training run imports as it runs
           *VLLM_ENGINE_MODULES, "matplotlib.pyplot", "transformers.trainer_utils", "rlhf.trainers.ppo_run",
           *TRAINING_RUN_MODULES, "tests.preloaded"]
"""What the ranks' forkserver imports once per test process, so that a rank starts as a fork of an interpreter that
has them instead of importing them again (10-15 s a rank on 2 CPU cores; a module missing here, vLLM say,
is skipped); `tests.preloaded`, last, then does what the ranks would each do again with them (the product launcher's
`prepare_workers`). Imported with OMP_NUM_THREADS=1 (tests/conftest.py): vLLM's engine module runs a torch operation at
import, which would otherwise start an OpenMP pool in the forkserver before it forks. Not where CUDA is
available: importing DeepSpeed there initializes the driver, and a forked child could not use the GPU."""


def _context():
    """The ranks' process context: a forkserver preloaded with PRELOAD on a machine without CUDA, else spawn."""
    import torch

    if torch.cuda.is_available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _entry(rank: int, world_size: int, port: int, out_dir: str, fn, args, environ: dict, init_group: bool) -> None:
    import torch.distributed as dist

    os.environ.clear()  # the caller's environment now, as a spawned process would have it (the forkserver has
    os.environ.update(environ)  # the one of its start)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    try:
        if init_group:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(*args)
        with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
            pickle.dump(("ok", result), f)
    except BaseException:
        with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
            pickle.dump(("error", traceback.format_exc()), f)
        raise
    from rlhf.cli.entry_point import end_program

    end_program()  # as a job's program: no seconds of interpreter finalization per rank


def run_on_ranks(world_size: int, fn, *args, init_group: bool = True, timeout: float = 600) -> list:
    """fn(*args) on every rank of a fresh gloo world; returns the per-rank results in rank order.

    `fn` must be importable (module level) so the rank processes can find it. Each rank has the caller's
    environment plus the variables a launcher sets (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT). `init_group=False` leaves the default group to `fn` (a job initialises its own). A rank still
    running after `timeout` seconds is killed and reported. A world whose rendezvous port (a free one, picked
    here) was taken by another process before rank 0 bound it is started again on a new port (twice at most): its
    other ranks, which would wait for that rendezvous until the timeout, are killed at once.
    """
    for attempt in range(3):
        with tempfile.TemporaryDirectory() as out_dir:
            procs = _start_world(world_size, free_port(), out_dir, fn, args, init_group)
            hung = _wait_world(procs, out_dir, timeout)
            if hung is not None or attempt == 2:
                return _world_results(procs, out_dir, timeout, hung or set())
    raise AssertionError("unreachable")


def _start_world(world_size: int, port: int, out_dir: str, fn, args, init_group: bool) -> list:
    ctx = _context()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, out_dir, fn, args, dict(os.environ), init_group))
             for r in range(world_size)]
    for p in procs:
        p.start()
    return procs


def _rank_outcome(out_dir: str, rank: int) -> tuple[str, object] | None:
    path = os.path.join(out_dir, f"{rank}.pkl")
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return pickle.load(f)


def _wait_world(procs: list, out_dir: str, timeout: float) -> set[int] | None:
    """Wait for every rank; the ranks still running at the deadline are killed and returned. None when rank 0
    failed because its rendezvous port was taken (the other ranks killed then)."""
    import time
    from multiprocessing.connection import wait

    deadline = time.monotonic() + timeout
    running = {p.sentinel: p for p in procs}
    while running and time.monotonic() < deadline:
        for sentinel in wait(list(running), timeout=max(0.0, deadline - time.monotonic())):
            running.pop(sentinel).join()
        outcome = _rank_outcome(out_dir, 0) if not procs[0].is_alive() else None
        if outcome and outcome[0] != "ok" and (PORT_TAKEN in outcome[1] or rendezvous_port_taken(outcome[1])):
            _kill(running.values())
            return None
    _kill(running.values())
    return {procs.index(p) for p in running.values()}


def _kill(procs) -> None:
    for p in procs:
        p.kill()
        p.join()


def _world_results(procs: list, out_dir: str, timeout: float, hung: set[int]) -> list:
    results = []
    for r, proc in enumerate(procs):
        outcome = _rank_outcome(out_dir, r)
        if outcome is None:
            raise RuntimeError(f"rank {r} " + (f"still ran after {timeout:.0f} s (killed)" if r in hung else
                               f"died without a result (exit code {proc.exitcode})"))
        status, value = outcome
        if status != "ok":
            raise RuntimeError(f"rank {r} failed:\n{value}")
        if proc.exitcode != 0:  # an abort in the teardown, after the result
            raise RuntimeError(f"rank {r} exited with code {proc.exitcode} after returning its result")
        results.append(value)
    return results


def _each_variant(variants: list[tuple]) -> list:
    return [fn(*args) for fn, *args in variants]


def run_variants_on_ranks(world_size: int, variants: list[tuple]) -> list[list]:
    """fn(*args) for every `(fn, *args)` in `variants`, one after another in the same fresh gloo world (one
    process start for all of them); returns, per variant, the per-rank results in rank order."""
    per_rank = run_on_ranks(world_size, _each_variant, variants)
    return [[results[i] for results in per_rank] for i in range(len(variants))]


@contextmanager
def exclusive(name: str) -> Iterator[None]:
    """Holds a machine-wide lock named `name` (a file lock): tests that cannot overlap (the private SLURM cluster)
    run one at a time whatever pytest-xdist worker runs them."""
    import fcntl

    with open(os.path.join(tempfile.gettempdir(), f"spmd-rlhf-tests-{name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


PORT_TAKEN = "EADDRINUSE"
"""In torchrun's error when the free port picked for its rendezvous was taken by another process (another test's
engine, say) before torchrun bound it: nothing has run yet, so the launch is retried on a new port."""


def run_torchrun(nproc: int, target: str, *args: str, timeout: int = 600,
                 launcher: str = "torch.distributed.run") -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node nproc target args...` from the repository root (`launcher`: the product's
    `rlhf.cli.launch` in its place); `target` is a script path or `-m module`. A launch whose rendezvous port was
    taken in the meantime is retried (twice)."""
    target_args = target.split(" ", 1) if target.startswith("-m ") else [target]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    for attempt in range(3):
        cmd = [sys.executable, "-m", launcher, f"--nproc_per_node={nproc}",
               "--master_addr=127.0.0.1", f"--master_port={free_port()}", *target_args, *args]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode == 0 or not rendezvous_port_taken(proc.stderr) or attempt == 2:
            if proc.returncode == 0:
                assert_clean_exit(proc)
            return proc
    raise AssertionError("unreachable")


VARIANT_MARK = "=== variant "


def _run_jobs_on_this_rank(runs: list[tuple[str, list[str]]], consoles: list[str]) -> None:
    """The jobs of `runs` one after another in this rank's process, its stdout and stderr written to
    `consoles[RANK]`.out/.err with VARIANT_MARK and the run's index before each run."""
    import importlib

    console = consoles[int(os.environ["RANK"])]
    with open(f"{console}.out", "wb", buffering=0) as out, open(f"{console}.err", "wb", buffering=0) as err:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        for i, (module, argv) in enumerate(runs):
            print(f"{VARIANT_MARK}{i} ===", flush=True)
            print(f"{VARIANT_MARK}{i} ===", file=sys.stderr, flush=True)
            # --watchdog_interval 0: the watchdog of an earlier run would otherwise time the later ones
            job = importlib.import_module(module if "." in module else f"rlhf.cli.{module}")
            job.main([*argv, "--watchdog_interval", "0"])
        sys.stdout.flush()
        sys.stderr.flush()


def run_job_variants(nproc: int, runs: list[tuple[str, list[str]]], console_dir, *save_paths,
                     timeout: int = 1500) -> list[str]:
    """Each (module, argv) of `runs` (module: `train_ppo`, `train_sft`, ... of rlhf.cli, or a dotted module with the
    same `main(argv)`) one after another in the same `nproc` rank processes (`run_on_ranks` with the job initialising
    its own group: one process start, one process group, the libraries imported once by the forkserver), as a launcher
    would run them: the variants of one equivalence pay one start. Each rank's console goes to `console_dir`. Asserts
    that every rank finished and printed no traceback (nor did the logs of `save_paths`); returns each run's console
    output (every rank's stdout, then every rank's stderr), in order."""
    os.makedirs(console_dir, exist_ok=True)
    consoles = [os.path.join(str(console_dir), f"rank{r}") for r in range(nproc)]
    try:
        run_on_ranks(nproc, _run_jobs_on_this_rank, runs, consoles, init_group=False, timeout=timeout)
    except RuntimeError as failure:
        raise AssertionError(f"{failure}\n{_read_consoles(consoles)[-6000:]}") from None
    parts = {stream: [_read(f"{console}.{stream}").split(VARIANT_MARK)[1:] for console in consoles]
             for stream in ("out", "err")}
    assert all(len(sections) == len(runs) for per_rank in parts.values() for sections in per_rank), \
        _read_consoles(consoles)[-3000:]
    outputs = ["".join(sections[i] for stream in ("out", "err") for sections in parts[stream])
               for i in range(len(runs))]
    assert_clean_output("".join(outputs), "", *save_paths)
    return outputs


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def _read_consoles(consoles: list[str]) -> str:
    return "".join(_read(f"{console}.{stream}") for stream in ("out", "err") for console in consoles
                   if os.path.exists(f"{console}.{stream}"))


CRASH_MARKS = ("Traceback (most recent call last)", "terminate called")
"""What a run that succeeded must never print: a Python traceback, or a C++ abort (`terminate called ...`)."""


def assert_clean_exit(proc: subprocess.CompletedProcess, *save_paths) -> None:
    """A run that exited 0 printed no traceback or abort on its console, nor in the `logs/` of `save_paths`
    (the libraries' full output)."""
    assert_clean_output(proc.stdout or "", proc.stderr or "", *save_paths)


def assert_clean_output(stdout: str, stderr: str, *save_paths) -> None:
    """`assert_clean_exit` for the output of a process read otherwise (`Popen.communicate`)."""
    texts = {"stdout": stdout or "", "stderr": stderr or ""}
    for save_path in save_paths:
        logs = os.path.join(str(save_path), "logs")
        for name in sorted(os.listdir(logs)) if os.path.isdir(logs) else ():
            with open(os.path.join(logs, name), errors="replace") as f:
                texts[os.path.join(logs, name)] = f.read()
    for where, text in texts.items():
        for mark in CRASH_MARKS:
            at = text.find(mark)
            assert at < 0, f"exit 0, but {where} holds {mark!r}:\n{text[max(0, at - 500):at + 3000]}"


LAUNCHER_PORT_TAKEN = PORT_IN_USE
"""rlhf.cli.launch's refusal of a --master_port another process took between `free_port` and the launch, and rank
0's where it hosts the rendezvous store itself (the examples' tests start their ranks without torchrun's agent)."""


def rendezvous_port_taken(stderr: str) -> bool:
    """torchrun failed binding its rendezvous store, or rlhf.cli.launch refused the taken port (before any
    worker started)."""
    return (PORT_TAKEN in stderr and "next_rendezvous" in stderr) or LAUNCHER_PORT_TAKEN in stderr
