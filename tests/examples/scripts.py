"""Shared by the example tests: run a launch/examples script, read its metrics.jsonl rows."""

import json
import os
import subprocess
import time

from tests.distributed import ROOT, assert_clean_exit, rendezvous_port_taken


def run_script(script: str, out, *args: str, timeout: int = 900) -> float:
    """Runs `bash launch/examples/SCRIPT OUT ARGS...`; returns its wall time in seconds. A run whose rendezvous
    port (the free one the script picked) was taken by another process before rank 0 bound it is run again
    (twice at most): nothing had started, and the script picks a new port each time."""
    start = time.monotonic()
    for attempt in range(3):
        proc = subprocess.run(["bash", f"launch/examples/{script}", str(out), *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": ROOT})
        if proc.returncode == 0 or not rendezvous_port_taken(proc.stderr) or attempt == 2:
            break
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert_clean_exit(proc, out)
    return time.monotonic() - start


def metric_rows(path, key: str) -> list[tuple[int, float]]:
    """(step, value) of every row of path/metrics.jsonl that has `key`."""
    with open(path / "metrics.jsonl") as f:
        return [(row["step"], row[key]) for row in map(json.loads, f) if key in row]


def before_after(path, key: str, name: str, what: str) -> tuple[float, float]:
    """The held-out metric `key` before training (step 0) and at the last evaluation, printed as `name: what`."""
    evals = metric_rows(path, key)
    assert evals[0][0] == 0 and evals[-1][0] > 0, evals
    before, after = evals[0][1], evals[-1][1]
    print(f"{name}: {what} {before:.3f} before, {after:.3f} after {evals[-1][0]} steps")
    return before, after
