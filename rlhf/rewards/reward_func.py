"""Rewards from a user's Python file defining `reward_func(queries, prompts, labels)` (OpenRLHF's
`--remote_rm_url path/to/file.py` convention). The function may return a tensor or list of rewards,
or a dict with "rewards" and optionally "scores" and "extra_logs"."""

from __future__ import annotations

import importlib.util
import os
import signal
import threading
from collections.abc import Callable

from rlhf.rewards.base import RewardInputs, RewardResult, result_from_output
from rlhf.utils import watchdog


def load_reward_func(path: str) -> Callable:
    """Import `path` and return its `reward_func`, or raise ValueError naming what is wrong."""
    if not os.path.isfile(path):
        raise ValueError(f"--remote_rm_url {path}: file not found (expected a .py file defining reward_func)")
    spec = importlib.util.spec_from_file_location("rlhf_user_reward", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"--remote_rm_url {path}: not an importable Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    func = getattr(module, "reward_func", None)
    if not callable(func):
        raise ValueError(f"--remote_rm_url {path} defines no function reward_func(queries, prompts, labels); "
                         "add one that returns one reward per query")
    return func


class RewardFuncTimeout(RuntimeError):
    """A reward_func call did not return within --reward_func_timeout seconds."""


class RewardFuncFile:
    """A `RewardSource` backed by a reward_func file.

    `timeout_s` > 0 bounds each call; one that has not returned after `timeout_s` seconds raises
    `RewardFuncTimeout` naming the file, and the error ends this rank (torchrun, or srun with
    --kill-on-bad-exit, then stops the others). In the main thread (training) the function runs there,
    as in OpenRLHF, so functions that use signals themselves (SIGALRM-based timeouts) keep working; on
    timeout a SIGUSR2 (handled only during the call) interrupts it: Python code and blocking waits
    (sleep, locks, sockets) are interrupted, but C code that never returns to Python (a runaway regex)
    is not, and then only `--dist_timeout` ends the run. Elsewhere (a server thread) it runs in a daemon
    worker thread, which Python cannot kill: a hung call keeps running until the process exits.
    `timeout_s` = 0 calls the function directly, without a limit.
    """

    INTERRUPT = signal.SIGUSR2

    def __init__(self, path: str, timeout_s: float = 0.0) -> None:
        self.path, self.timeout_s = path, timeout_s
        self.func = load_reward_func(path)
        # a file may declare the words that make a response bad (the analytic P(bad)'s default set)
        bad = self.func.__globals__.get("BAD_WORDS")
        self.bad_words: tuple[str, ...] | None = tuple(bad) if bad is not None else None

    def score(self, batch: RewardInputs) -> RewardResult:
        with watchdog.stage("reward_func"):
            out = self._call(batch.queries, batch.prompts, batch.labels)
        return result_from_output(out, len(batch.queries), f"reward_func in {self.path}")

    def _call(self, queries: list[str], prompts: list[str], labels: list):
        if self.timeout_s <= 0:
            return self.func(queries, prompts, labels)
        if threading.current_thread() is threading.main_thread():
            return self._call_interruptible(queries, prompts, labels)
        return self._call_in_thread(queries, prompts, labels)

    def _timeout(self, num_queries: int) -> RewardFuncTimeout:
        return RewardFuncTimeout(f"reward_func in {self.path} did not return within {self.timeout_s:g} s "
                                 f"(--reward_func_timeout) for {num_queries} queries; fix the function or raise "
                                 "the limit (0: none)")

    def _call_interruptible(self, queries: list[str], prompts: list[str], labels: list):
        """Call in this (the main) thread; a timer thread signals it when the time is up."""
        lock, state = threading.Lock(), {"done": False}  # no signal once the call has returned

        def on_signal(signum, frame) -> None:
            if not state["done"]:
                raise self._timeout(len(queries))

        def fire() -> None:
            with lock:
                if not state["done"]:
                    signal.pthread_kill(threading.main_thread().ident, self.INTERRUPT)

        previous = signal.signal(self.INTERRUPT, on_signal)
        timer = threading.Timer(self.timeout_s, fire)
        timer.daemon = True
        timer.start()
        try:
            return self.func(queries, prompts, labels)
        finally:
            with lock:
                state["done"] = True
            timer.cancel()
            signal.signal(self.INTERRUPT, previous)

    def _call_in_thread(self, queries: list[str], prompts: list[str], labels: list):
        """Call in a daemon worker thread and give up waiting after the timeout."""
        box: dict = {}

        def target() -> None:
            try:
                box["out"] = self.func(queries, prompts, labels)
            except BaseException as err:  # re-raised in the caller's thread below
                box["error"] = err

        worker = threading.Thread(target=target, name="reward_func", daemon=True)
        worker.start()
        worker.join(self.timeout_s)
        if worker.is_alive():
            raise self._timeout(len(queries))
        if "error" in box:
            raise box["error"]
        return box["out"]
