"""Warm start: torchrun's workers forked from the launcher after it has imported their libraries, once.

A training program's ranks spend most of a short job's start importing torch, transformers, DeepSpeed, vLLM and the
job's modules (10-20 s a rank on a 2-core machine, every rank at once). On a machine without CUDA,
`rlhf.cli.launch` imports them once, before torchrun starts (`warm_modules`: the program says which), and
torchrun's workers are then forked from it (`install`) instead of started as new interpreters
(`python -u -m rlhf.cli.<program> ...`): each begins where a new one would be after its imports. A restart by
--max-restarts forks again from the same launcher, so it skips the imports too.

A forked worker is given what a new interpreter would have: its environment (torchrun's per-rank variables), a
session of its own (torchrun stops workers by process group), its standard streams (torchrun's redirects,
unbuffered as `-u` makes them), no other inherited file descriptor, the default signal handlers, Python's and
NumPy's random state drawn anew, OMP_NUM_THREADS threads (the OpenMP runtime read the launcher's environment when
it loaded), `sys.argv` and `__main__` as `python -m` sets them, and the interpreter's exit (threads joined, atexit
handlers run, the status of a `SystemExit`, a traceback and status 1 for an uncaught error). It never returns
into the launcher's code.

Where CUDA is available the workers start as new interpreters, as before: a process that has asked the CUDA
driver anything (the launcher has) must not fork children that use it. `--no_warm_start` starts them so
everywhere.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import io
import logging
import os
import random
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn, TextIO

PROGRAM_PACKAGE = "rlhf.cli."  # the programs whose workers may be forked: the product's own

HELD: list[logging.LogRecord | warnings.WarningMessage | str] = []
"""What the launcher's imports logged, warned or wrote (`imports_held`), for each worker to replay once its console
routing is in place (`replay_held`), as it would have seen it importing them itself."""


class ForkedWorker:
    """The part of `subprocess.Popen` that torchrun's `SubprocessHandler` uses, for a forked worker: `pid`,
    `returncode`, `poll`, `wait`, `send_signal`, `terminate`, `kill`. Its return code is the exit status, or minus
    the signal that ended it, as `Popen` reports them."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.args = ["forked worker", str(pid)]

    def _reap(self, flags: int) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, flags)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def poll(self) -> int | None:
        return self._reap(os.WNOHANG)

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None:
            return self._reap(0)  # type: ignore[return-value]
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def worker_target(args: Sequence[str], program: str) -> list[str] | None:
    """The program's arguments when torchrun's worker command `args` is `python -u -m program ...` (what torchrun
    builds for `-m program`); None for any other command, which starts as a new interpreter."""
    args = list(args)
    if len(args) >= 4 and args[0] == sys.executable and args[1:4] == ["-u", "-m", program]:
        return args[4:]
    return None


def install(program: str) -> None:
    """Make torchrun fork its workers from this process when their command is `python -u -m program ...`."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import SubprocessHandler

    popen = SubprocessHandler._popen

    def _popen(handler: Any, args: tuple, env: dict[str, str]) -> Any:
        program_args = worker_target(args, program)
        if program_args is None:
            return popen(handler, args, env)
        return fork_worker(program, program_args, env, handler._stdout, handler._stderr)

    SubprocessHandler._popen = _popen


def fork_worker(program: str, program_args: list[str], env: dict[str, str], stdout: TextIO | None,
                stderr: TextIO | None) -> ForkedWorker:
    """A worker running `python -u -m program *program_args` with environment `env` (and stdout/stderr into
    these files where given), forked from this process, in a session of its own."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    cpus = os.sched_getaffinity(0)
    pid = os.fork()
    if pid:
        return ForkedWorker(pid)
    try:
        os.setsid()
        streams = {fd: target.fileno() for fd, target in ((1, stdout), (2, stderr)) if target is not None}
        become_worker(program, program_args, env, streams, cpus)
    except BaseException:  # noqa: BLE001 -- the worker could not be set up
        with contextlib.suppress(BaseException):
            traceback.print_exc()
    finally:  # it never returns into the launcher's code
        os._exit(1)


def become_worker(program: str, program_args: list[str], env: dict[str, str], streams: dict[int, int],
                  cpus: set[int]) -> NoReturn:
    """Turn this freshly forked process into `python -u -m program *program_args`, as a new interpreter would
    start it (see the module's docstring), and end it with the program's exit status. `streams`: {standard
    descriptor: the descriptor it becomes a copy of}; `cpus`: the CPUs of the process it was forked from."""
    gc.freeze()  # the parent's objects stay as they are: none is collected (closing a descriptor) in the worker
    # Intel OpenMP (libiomp5, preloaded for vLLM) pins a forked child to the CPU its parent ran on: the worker gets
    # its parent's CPUs back, as a new process has them (two ranks on one core run at half speed)
    os.sched_setaffinity(0, cpus)
    _name_as_exec_gives()
    for fd, source in streams.items():
        os.dup2(source, fd)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    for sig in signal.valid_signals():
        handler = signal.getsignal(sig)
        if callable(handler) and handler is not signal.default_int_handler:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(env)
    _fresh_process_state()
    sys.stdout = sys.__stdout__ = _unbuffered(1, sys.__stdout__)
    sys.stderr = sys.__stderr__ = _unbuffered(2, sys.__stderr__)
    sys.argv = ["-m", *program_args]
    sys.modules.pop(program, None)  # imported by the parent; `python -m` runs it as __main__ only
    run_as_main(lambda: runpy.run_module(program, run_name="__main__", alter_sys=True))


PR_SET_NAME = 15  # prctl(2)


def _name_as_exec_gives() -> None:
    """The process's name (what top and ps show) as the interpreter's exec gives it: the executable's file name,
    not the name of the launcher's thread that forked it (torchrun's `pt_elastic`)."""
    name = os.path.basename(sys.executable).encode()[:15]  # the kernel keeps 15 bytes
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)


def _fresh_process_state() -> None:
    """What a new interpreter would have drawn or read at its start: random state, the OpenMP thread count."""
    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    torch = sys.modules.get("torch")
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


def _unbuffered(fd: int, like: TextIO | None) -> TextIO:
    """A text stream on `fd` as `python -u` makes stdout and stderr: each write reaches the descriptor."""
    return io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=getattr(like, "encoding", None) or "utf-8",
                            errors=getattr(like, "errors", None) or "strict", write_through=True)


def run_as_main(body: Callable[[], Any]) -> NoReturn:
    """Run `body` as an interpreter runs its main module, and end as it ends: the exit status of a `SystemExit`
    (its message on stderr when it is not a number), a traceback and status 1 for another error, and for an
    uncaught Ctrl-C the traceback and death by SIGINT. Then what finalization does that matters
    (`rlhf.cli.entry_point.end_program`)."""
    from rlhf.cli.entry_point import end_program

    try:
        body()
        status = 0
    except SystemExit as exit_:
        code = exit_.code
        if code is None or isinstance(code, int):
            status = code or 0
        else:
            print(code, file=sys.stderr)
            status = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        status = 128 + signal.SIGINT
    except BaseException:  # noqa: BLE001 -- the interpreter's report of an uncaught error
        traceback.print_exc()
        status = 1
    end_program(status)


def warm_modules(program: str, program_args: list[str]) -> list[str]:
    """The modules a worker of `program` will import (its job's, and vLLM's engine where it will generate with
    vLLM): the program's `warm_imports(argv)` where it has one, else its `JOB_MODULE`, and for a training program
    (`train_*`) `TRAINING_RUN_MODULES`; none for a program that is not the product's."""
    if not program.startswith(PROGRAM_PACKAGE):
        return []
    module = importlib.import_module(program)
    hook = getattr(module, "warm_imports", None)
    job = getattr(module, "JOB_MODULE", None)
    modules = list(hook(program_args)) if hook is not None else [job] if job else []
    training = program.startswith(f"{PROGRAM_PACKAGE}train_") and modules
    return [*modules, *TRAINING_RUN_MODULES] if training else modules


def quietly_parsed(config_cls: type, argv: list[str], prog: str) -> Any | None:
    """`config_cls` parsed from `argv` with nothing printed; None where the flags are refused (each rank will
    say why)."""
    from rlhf.config.flags import parse_config

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return parse_config(config_cls, argv, prog=prog)
        except (Exception, SystemExit):  # noqa: BLE001 -- refused flags: the workers report them
            return None


VLLM_ENGINE_MODULES = ["vllm", "vllm.entrypoints.llm", "vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner",
                       "vllm.model_executor.layers.quantization.online.base", "vllm.entrypoints.launchers.cli_args"]
"""vLLM's engine, its CPU worker (the warm start runs only where there is no CUDA), and what the engine imports as
it loads the model and logs its settings, which every worker would otherwise import as it starts (0.8 s a rank on a
2-core machine)."""

TRAINING_RUN_MODULES = ["transformers.optimization", "rlhf.planning.job_memory", "rlhf.planning.report"]
"""What every training program's run imports only once it runs: the learning-rate schedules, and the memory plan
logged beside the measured peaks (0.4-0.5 s a rank on a 2-core machine)."""


def prepare_workers(modules: list[str]) -> None:
    """What each worker would do again at its start with `modules` imported, done once here, before the workers
    are forked: vLLM's CPU kernel stand-ins registered (`register_cpu_kernels_once`, 0.3-0.7 s a rank) where
    `modules` hold vLLM's CPU worker; DeepSpeed's Muon optimizer imported, which its `initialize` imports to check
    the optimizer, and with it torch's Inductor (1.3 s a rank of a job without vLLM); and transformers' table of
    checkpoint conversions built (every model load reads it: 0.1-0.2 s a process)."""
    if "vllm.v1.worker.cpu_worker" in modules:
        from rlhf.engines.vllm_engine import register_cpu_kernels_once

        register_cpu_kernels_once()
    if "deepspeed" in sys.modules:
        with contextlib.suppress(ImportError):  # a DeepSpeed without it (< 0.18) does not import it either
            importlib.import_module("deepspeed.runtime.zero.muon.muon_optimizer")
    conversion = sys.modules.get("transformers.conversion_mapping")
    if conversion is not None and hasattr(conversion, "get_checkpoint_conversion_mapping"):  # transformers >= 5
        conversion.get_checkpoint_conversion_mapping("llama")  # builds the table, cached for the process


def rollout_modules(config_cls: type, argv: list[str], prog: str) -> list[str]:
    """vLLM's engine modules where an RL program's rollout flags choose vLLM (`rollout_engine_choice`)."""
    cfg = quietly_parsed(config_cls, argv, prog)
    if cfg is None:
        return []
    from rlhf.engines.rollout import rollout_engine_choice

    return VLLM_ENGINE_MODULES if rollout_engine_choice(cfg.rollout)[0] == "vllm" else []


class _Holder(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        HELD.append(record)


@contextlib.contextmanager
def imports_held(verbose: bool) -> Iterator[None]:
    """Inside the block (the launcher's imports), log records reaching the root logger, warnings, and what is
    written to file descriptors 1 and 2 are held in `HELD`, not shown. vLLM is told to leave its loggers to the
    workers' routing (`VLLM_CONFIGURE_LOGGING=0`, as `rlhf.utils.console` tells it) unless `verbose` (--verbose:
    every library as it sets itself up) or the user configured vLLM's logging. If the block raises, what it held is
    shown."""
    configure = None
    if not verbose and "VLLM_LOGGING_CONFIG_PATH" not in os.environ and "VLLM_CONFIGURE_LOGGING" not in os.environ:
        configure = os.environ["VLLM_CONFIGURE_LOGGING"] = "0"
    holder = _Holder(logging.WARNING)
    logging.root.addHandler(holder)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = [os.dup(1), os.dup(2)]
    ok = False
    with tempfile.TemporaryFile() as held, warnings.catch_warnings(record=True) as caught:
        os.dup2(held.fileno(), 1)
        os.dup2(held.fileno(), 2)
        try:
            yield
            ok = True
        finally:
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            for fd, copy in zip((1, 2), saved):
                os.dup2(copy, fd)
                os.close(copy)
            logging.root.removeHandler(holder)
            if configure is not None:
                del os.environ["VLLM_CONFIGURE_LOGGING"]
            held.seek(0)
            text = held.read().decode(errors="replace")
            HELD.extend(caught)
            if text:
                HELD.append(text)
            if not ok:
                replay_held()


def replay_held() -> None:
    """Show what the launcher's imports held (`imports_held`) through this process's logging, warnings and stderr:
    in a worker after its console routing is installed, so each goes where the routing sends it. Once."""
    while HELD:
        item = HELD.pop(0)
        if isinstance(item, logging.LogRecord):
            logging.getLogger(item.name).handle(item)
        elif isinstance(item, warnings.WarningMessage):
            warnings.showwarning(item.message, item.category, item.filename, item.lineno, item.file, item.line)
        else:
            sys.stderr.write(item)
            sys.stderr.flush()
