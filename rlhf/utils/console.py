"""What a run shows on the console: our own output, plus each distinct third-party warning once.

Libraries (vLLM, DeepSpeed, torch, transformers, accelerate, huggingface_hub) repeat the same
warnings on every rank and often every step. `route_library_output` sends their output to this
rank's `<save_path>/logs/rank<N>.log` (log records at WARNING and above, warnings, direct writes), and
rank 0 prints the first occurrence of each distinct warning as `[vllm] WARNING: ... (repeats are
logged to FILE)`; other ranks print none of it. Notices that ask nothing of the user go to the file
only, with one console line saying so the first time: a deprecation raised inside a library (one
library calling another's old API: only a new release of it can change that) and `KNOWN_NOTICES`,
vLLM's and torch's notes on the CPU build and on settings this product makes on purpose. Our own
prints, `rlhf` warnings and the progress bar stay on the console. `--verbose` leaves every library as
it set itself up.

Three channels are routed:
- python `logging`: the console handlers of the libraries' loggers are replaced by a routing handler.
  vLLM configures its loggers when imported; `VLLM_CONFIGURE_LOGGING=0` (unless the user set it or a
  vLLM logging config file) makes it leave them to us, so this must run before vLLM is imported.
- `warnings.warn`: a warning whose filename lies inside a library goes to the file (console once).
- direct writes to `sys.stdout` / `sys.stderr` (library prints, library progress bars): a write goes
  to the file when the innermost calling frame that belongs to `rlhf` or to a library is a library's.

C++ output bypasses Python's streams; inside a `native_output_routed()` block (the vLLM engine's start-up,
where vLLM's CPU extension warns about its NUMA binding on every rank) torch's `[W... ] Warning:` lines are
routed too. Not routed: output written before this runs (import-time messages such as DeepSpeed's
"Setting accelerator to CPU"), loggers a library configures later with its own console handler, and C++
output outside such a block. This module knows nothing of torch.distributed: the caller passes its rank.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from rlhf.config.shared_config import LoggingConfig

LIBRARIES = ("vllm", "deepspeed", "torch", "transformers", "accelerate", "huggingface_hub")
"""Packages whose output is routed to the run's log file."""

LOGGER_ROOTS = {"vllm": "vllm", "DeepSpeed": "deepspeed", "deepspeed": "deepspeed", "torch": "torch",
                "transformers": "transformers", "accelerate": "accelerate", "huggingface_hub": "huggingface_hub"}
"""Root of a library's logger hierarchy -> the library (DeepSpeed logs under "DeepSpeed")."""


DEPRECATIONS = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)
"""Warning categories that, raised inside a library, are one library's use of another's (or its own) old API."""

KNOWN_NOTICES: tuple[tuple[str, re.Pattern[str]], ...] = (
    # vLLM's CPU build runs no Triton kernel: a Triton without a CPU backend, no triton-cpu, and the V1 model runner
    # it then uses (the one this product drives on CPU) are its normal state
    ("vllm", re.compile(r"Triton is installed, but doesn't include CPU backend|Triton is not installed\. "
                        r"triton-cpu is expected|Model Runner V2 requires Triton")),
    # the engine runs inside the trainer's process on purpose (rlhf.engines.vllm_engine): the trainer draws from
    # streams it seeds itself, so a resumed run still equals the straight one (tests/e2e/test_checkpoint_resume.py)
    ("vllm", re.compile(r"The global random seed is set to -?\d+\. Since VLLM_ENABLE_V1_MULTIPROCESSING is set to "
                        r"False")),
    # vLLM restating --enforce_eager
    ("vllm", re.compile(r"Enforce eager set, disabling torch\.compile|Inductor compilation was disabled by user "
                        r"settings")),
    # vLLM's CPU worker binds its threads and memory to its NUMA node; the engine puts torch's thread count back
    ("vllm", re.compile(r"CPU backend doesn't allow to use `torch\.set_num_threads` after the thread binding")),
    ("torch", re.compile(r"NUMA binding: Using MEMBIND policy")),
    # on a CPU with AVX-512 BF16 (Intel Xeon) vLLM resets the Mamba state cache's dtype for every model; backend 'none'
    # is a model without Mamba layers (every dense model), where there is no such cache
    ("vllm", re.compile(r"Reset SSM cache type to float32 for accelerated GDN mamba backend 'none'")),
)
"""(library, message pattern) of the notices known to need nothing from the user, each with its reason above."""


def known_notice(library: str, message: str) -> bool:
    """Whether `library`'s `message` is one of `KNOWN_NOTICES`."""
    return any(owner == library and pattern.search(message) for owner, pattern in KNOWN_NOTICES)


class _Owners:
    """Which package a source file belongs to: "rlhf", one of LIBRARIES, or None (stdlib, others)."""

    def __init__(self, packages: tuple[str, ...] = LIBRARIES + ("rlhf",)) -> None:
        self._dirs: list[tuple[str, str]] = []
        for name in packages:
            spec = importlib.util.find_spec(name)
            for location in (spec.submodule_search_locations or []) if spec else []:
                for path in {os.path.abspath(location), os.path.realpath(location)}:
                    self._dirs.append((os.path.join(path, ""), name))
        self._cache: dict[str, str | None] = {}

    def __call__(self, filename: str) -> str | None:
        if filename not in self._cache:
            self._cache[filename] = next((name for d, name in self._dirs if filename.startswith(d)), None)
        return self._cache[filename]


class _RunLog:
    """This rank's log file (created on the first write) and the library messages the console has shown.

    `console` is None on ranks that show nothing. `console_mid_line` is set while the console's last
    write left a line open (a progress bar), so that a console line starts on a fresh one. Thread-safe.
    """

    def __init__(self, path: str, console: TextIO | None) -> None:
        self.path = path
        self.console = console
        self.console_mid_line = False
        self._file: TextIO | None = None
        self._shown: set[tuple[str, str]] = set()
        self._quiet_said = False
        self._lock = threading.Lock()

    def write(self, text: str) -> None:
        """Append `text` to the file. Where the file cannot be written (an unwritable --save_path, which the
        job's checks report next as its one `error:` line; a full disk), the text goes to the console of rank
        0 instead, never a logging traceback."""
        with self._lock:
            try:
                if self._file is None:
                    os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
                    self._file = open(self.path, "a", encoding="utf-8")  # kept open for the whole run
                self._file.write(text)
                self._file.flush()
                return
            except OSError:
                pass
        if self.console is not None:
            self.console.write(text)
            self.console.flush()

    def report(self, library: str, kind: str, message: str, line: str, quiet: bool = False) -> None:
        """Append `line` to the file; on the console, show `[library] kind: message` the first time. A `quiet`
        one (a notice that asks nothing of the user) is not shown: the first of them says where they go."""
        self.write(line)
        key = (library, message)
        with self._lock:
            if self.console is None or key in self._shown or (quiet and self._quiet_said):
                return
            if quiet:
                self._quiet_said = True
                text = (f"[libraries] notices that ask nothing of you (deprecations inside the libraries, vLLM's "
                        f"CPU-build notes: rlhf.utils.console) are logged to {self.path} only; --verbose shows them")
            else:
                self._shown.add(key)
                text = f"[{library}] {kind}: {message} (repeats are logged to {self.path})"
            newline = "\n" if self.console_mid_line else ""
            self.console_mid_line = False
        self.console.write(f"{newline}{text}\n")
        self.console.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


class _LibraryLogHandler(logging.Handler):
    """Replaces a library logger's console handler: records go to the run log."""

    def __init__(self, run_log: _RunLog, library: str) -> None:
        super().__init__(logging.WARNING)
        self.run_log = run_log
        self.library = library
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(filename)s:%(lineno)d] "
                                            "%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            self.run_log.report(self.library, record.levelname, message, self.format(record) + "\n",
                                quiet=known_notice(self.library, message))
        except Exception:
            self.handleError(record)


class _LibraryOutputStream:
    """Stands in for sys.stdout or sys.stderr: writes made by library code go to the run log, all
    others to the real stream. Everything but `write`/`writelines` is the real stream's."""

    def __init__(self, stream: TextIO, run_log: _RunLog, owners: _Owners) -> None:
        self._stream = stream
        self._run_log = run_log
        self._owners = owners

    def write(self, text: str) -> int:
        if self._caller_is_library():
            self._run_log.write(text)
            return len(text)
        if text:
            self._run_log.console_mid_line = not text.endswith("\n")
        return self._stream.write(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def _caller_is_library(self) -> bool:
        try:
            frame = sys._getframe(2)  # the caller of write()
        except ValueError:  # written from C with no Python frame (e.g. an uncaught exception's report)
            return False
        while frame is not None:
            owner = self._owners(frame.f_code.co_filename)
            if owner is not None:
                return owner != "rlhf"
            frame = frame.f_back
        return False

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _is_console_handler(handler: logging.Handler) -> bool:
    return (isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)
            and getattr(handler, "stream", None) in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__))


def _route_loggers(run_log: _RunLog) -> Callable[[], None]:
    """Give every library logger that would print (a console handler, or no propagation) the routing
    handler instead; returns the undo."""
    handlers: dict[str, _LibraryLogHandler] = {}
    changed: list[tuple[logging.Logger, list[logging.Handler], bool, logging.Handler | None]] = []
    existing = [name for name, lg in logging.root.manager.loggerDict.items() if isinstance(lg, logging.Logger)]
    for root, library in LOGGER_ROOTS.items():
        handler = handlers.setdefault(library, _LibraryLogHandler(run_log, library))
        for name in [root] + [n for n in existing if n.startswith(root + ".")]:
            logger = logging.getLogger(name)
            removed = [h for h in logger.handlers if _is_console_handler(h)]
            for h in removed:
                logger.removeHandler(h)
            added = handler if (name == root or not logger.propagate) else None
            changed.append((logger, removed, logger.propagate, added))
            if added is not None:
                logger.addHandler(added)
                logger.propagate = False

    def undo() -> None:
        for logger, removed, propagate, added in reversed(changed):
            if added is not None:
                logger.removeHandler(added)
            for h in removed:
                logger.addHandler(h)
            logger.propagate = propagate

    return undo


def _route_warnings(run_log: _RunLog, owners: _Owners, console: TextIO, rank: int) -> Callable[[], None]:
    """Library warnings to the run log; our own shown by rank 0 only (every rank runs the same checks, so
    the others would repeat them) and logged to the file elsewhere; all others shown as before (on the
    real stream). Returns the undo."""
    previous = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        library = owners(filename)
        if library == "rlhf" and rank != 0:
            run_log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {category.__name__} [{filename}:{lineno}] "
                          f"{message}\n")
            return
        if library == "rlhf" and file is None:  # our own notes read as sentences, not as source locations
            console.write(f"{category.__name__}: {message}\n")
            console.flush()
            return
        if library is None:
            previous(message, category, filename, lineno, console if file is None else file, line)
            return
        text = str(message)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        run_log.report(library, category.__name__, text, f"{stamp} {category.__name__} [{filename}:{lineno}] {text}\n",
                       quiet=issubclass(category, DEPRECATIONS) or known_notice(library, text))

    warnings.showwarning = showwarning

    def undo() -> None:
        if warnings.showwarning is showwarning:
            warnings.showwarning = previous

    return undo


def _report_uncaught(run_log: _RunLog, console: TextIO, rank: int) -> Callable[[], None]:
    """An uncaught exception is this process's last word: its traceback goes to the real stream on every
    rank (prefixed with the rank), whatever library raised it, and to the run log. Returns the undo."""
    previous = sys.excepthook

    def excepthook(kind, value, tb) -> None:
        text = "".join(traceback.format_exception(kind, value, tb))
        run_log.write(text)
        console.write(text if rank == 0 else "".join(f"[rank {rank}] {line}\n" for line in text.splitlines()))
        console.flush()

    sys.excepthook = excepthook

    def undo() -> None:
        if sys.excepthook is excepthook:
            sys.excepthook = previous

    return undo


class LibraryOutputRouting:
    """The routing installed by `route_library_output`; `uninstall()` puts everything back."""

    def __init__(self, path: str, rank: int) -> None:
        self.path = path
        console = sys.stderr
        self._run_log = _RunLog(path, console if rank == 0 else None)
        owners = _Owners()
        self._undo = [_route_loggers(self._run_log), _route_warnings(self._run_log, owners, console, rank)]
        self._streams = (sys.stdout, sys.stderr)
        self._undo.append(_report_uncaught(self._run_log, sys.stderr, rank))
        sys.stdout = _LibraryOutputStream(sys.stdout, self._run_log, owners)
        sys.stderr = _LibraryOutputStream(sys.stderr, self._run_log, owners)

    def replay_native(self, text: str) -> None:
        """What native code wrote to stderr inside `native_output_routed`: C++ warnings routed, the rest shown."""
        stderr = self._streams[1]
        for line in text.splitlines(keepends=True):
            match = NATIVE_WARNING.match(line)
            if match:
                self._run_log.report("torch", "WARNING", match.group(1), line,
                                     quiet=known_notice("torch", match.group(1)))
            else:
                stderr.write(line)
        stderr.flush()

    def uninstall(self) -> None:
        """Put back the streams, loggers and warning display found at install; a second call does nothing."""
        global _active
        if _active is self:
            _active = None
        if isinstance(sys.stdout, _LibraryOutputStream):
            sys.stdout = self._streams[0]
        if isinstance(sys.stderr, _LibraryOutputStream):
            sys.stderr = self._streams[1]
        while self._undo:
            self._undo.pop()()
        self._run_log.close()


_active: LibraryOutputRouting | None = None

NATIVE_WARNING = re.compile(r"^(?:\[rank\d+\]:)?\[W\d{4} [^\]]*\] Warning: (.*?)(?: \(function \w+\))?\s*$")
"""A C++ warning as torch's c10 logging writes it: `[rank0]:[W1129 04:43:58.131 utils.cpp:68] Warning: MESSAGE
(function NAME)`; group 1 is the message."""


@contextmanager
def native_output_routed() -> Iterator[None]:
    """Inside the block, what native code writes to file descriptor 2 is held in a temporary file; after it, each
    C++ warning line goes to the log file, shown once on rank 0's console as `[torch] WARNING: message`, and
    everything else written to stderr meanwhile is written on as it was. Nothing changes without an active
    routing (`--verbose`, or before `route_library_output`)."""
    routing = _active
    if routing is None:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            routing.replay_native(held.read().decode(errors="replace"))


def route_library_output(log: LoggingConfig, rank: int) -> LibraryOutputRouting | None:
    """Route third-party library output to `<log.save_path>/logs/rank<rank>.log`, showing each distinct
    library warning once on rank 0's console; with `log.verbose`, change nothing and return None.

    Called once per process by the entry point, after the flags are parsed and before vLLM is
    imported; a second call replaces the first. Every rank calls it; no collective.
    """
    global _active
    if _active is not None:
        _active.uninstall()
    if log.verbose:
        _replay_launcher_imports()
        return None
    if "VLLM_LOGGING_CONFIG_PATH" not in os.environ:
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # vLLM's loggers are then ours to route
    _active = LibraryOutputRouting(os.path.join(log.save_path, "logs", f"rank{rank}.log"), rank)
    _replay_launcher_imports()
    return _active


def _replay_launcher_imports() -> None:
    """In a worker forked from the launcher (`rlhf.cli.warm_start`): what the imports said there, shown now."""
    warm_start = sys.modules.get("rlhf.cli.warm_start")
    if warm_start is not None:
        warm_start.replay_held()
