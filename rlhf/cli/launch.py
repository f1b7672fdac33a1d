"""`torchrun` with preemption that works whichever process gets the signal:

    python -m rlhf.cli.launch [--grace_period S] [torchrun flags] -m rlhf.cli.train_ppo [train flags]

Plain torchrun handles SIGTERM by forwarding it to the workers and killing them 30 s later (then exits
1), and dies at once on SIGUSR1, leaving its workers running. This launcher runs torchrun in-process
with SIGTERM and SIGUSR1 taken out of torchrun's hands: on either, it forwards the signal to the workers
(each checkpoints at the end of its current step and exits 0, see `rlhf.utils.preemption`), waits up
to `--grace_period` seconds for them, and exits 0 when they did. If they have not finished by then it
stops them through torchrun's own shutdown (as for SIGINT) and exits non-zero. SIGINT (Ctrl-C), SIGHUP
and SIGQUIT keep torchrun's handling: the workers are stopped without a checkpoint.

It knows nothing about training: it only relays signals and times the grace period.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
TORCHRUN_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"  # torchrun keeps these; ours are PREEMPT_SIGNALS
DEFAULT_GRACE_S = 600.0


def split_grace_period(argv: list[str]) -> tuple[float, list[str]]:
    """(`--grace_period` seconds, the remaining arguments for torchrun). Only flags before the training
    program (`-m module` or a script) are ours to read."""
    end = next((i for i, a in enumerate(argv) if a in ("-m", "--module") or a.endswith(".py")), len(argv))
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
        for sig in PREEMPT_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        sig = signal.Signals(signum)
        workers = child_pids(os.getpid())
        for pid in workers:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if self.received is None:
            self.received, self.started = sig, time.monotonic()
            _say(f"got {sig.name}: asked {len(workers)} worker(s) to checkpoint and exit (grace period "
                 f"{self.grace_s:g} s)")
            threading.Thread(target=self._deadline, name="grace-period", daemon=True).start()

    def _deadline(self) -> None:
        time.sleep(self.grace_s)
        _say(f"the workers did not exit within the grace period ({self.grace_s:g} s, --grace_period): "
             "stopping them without a checkpoint")
        os.kill(os.getpid(), signal.SIGINT)  # torchrun's own shutdown path

    def summary(self) -> str | None:
        if self.received is None:
            return None
        return (f"preempted by {self.received.name}: the workers checkpointed and exited "
                f"{time.monotonic() - self.started:.0f} s after the signal")


def _say(message: str) -> None:
    print(f"[rlhf.cli.launch] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    try:
        grace, torchrun_args = split_grace_period(list(sys.argv[1:] if argv is None else argv))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    from torch.distributed import run as torchrun

    relay = SignalRelay(grace)
    torchrun.main([f"--signals_to_handle={TORCHRUN_SIGNALS}", *torchrun_args])
    summary = relay.summary()
    if summary:
        _say(summary)


if __name__ == "__main__":
    main()
