"""A private single-host SLURM for the launch tests: `launch/test_slurm_setup.sh` installs slurm-wlm and munge
(apt, as root) and starts munged, slurmctld and slurmd under one state directory; `SlurmCluster` submits,
waits on and reads jobs through it. Where the machine cannot (no root, no apt, a daemon that does not start)
the tests skip with the script's reason; a failure of anything else fails them."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tests.distributed import ROOT, exclusive

SETUP = os.path.join(ROOT, "launch", "test_slurm_setup.sh")
CANNOT = 3
"""The setup script's exit status for "cannot on this machine" (its last stderr line says why)."""
FINISHED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")


def _setup(*args: str, timeout: int = 600) -> str:
    """Runs the setup script; skips the calling test where it says it cannot, fails on anything else."""
    if sys.platform != "linux":
        pytest.skip("the private SLURM needs Linux")
    proc = subprocess.run(["bash", SETUP, *args], capture_output=True, text=True, timeout=timeout)
    if proc.returncode == CANNOT:
        pytest.skip(f"no private SLURM here: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, f"{SETUP} {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return proc.stdout


def _free_port_pair() -> int:
    """A port p with p and p + 1 free (slurmctld and slurmd)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("", port + 1))
                except OSError:
                    continue
        return port
    raise AssertionError("no two adjacent free ports")


class SlurmCluster:
    """Clients of one running private SLURM: `env` has SLURM_CONF (and PYTHONPATH for the jobs); `prefix` runs a
    client where slurmctld can be reached (in the first node's network namespace for `private_slurm(netns=)`)."""

    def __init__(self, state_dir: str, prefix: tuple[str, ...] = ()) -> None:
        self.state_dir, self.prefix = state_dir, prefix
        self.env = {**os.environ, "SLURM_CONF": os.path.join(state_dir, "slurm.conf"), "PYTHONPATH": ROOT,
                    "OMP_NUM_THREADS": "1"}

    def run(self, *cmd: str, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([*self.prefix, *cmd], cwd=ROOT, env={**self.env, **(env or {})}, capture_output=True,
                              text=True, timeout=timeout)

    def popen(self, *cmd: str, env: dict | None = None) -> subprocess.Popen:
        return subprocess.Popen([*self.prefix, *cmd], cwd=ROOT, env={**self.env, **(env or {})}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def sbatch(self, *args: str, env: dict | None = None) -> int:
        """`sbatch --parsable args` from the repository root; the job id."""
        proc = self.run("sbatch", "--parsable", f"--chdir={ROOT}", *args, env=env)
        assert proc.returncode == 0, proc.stderr
        return int(proc.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, StdOut, ...)."""
        proc = self.run("scontrol", "show", "job", "-o", str(job_id))
        assert proc.returncode == 0, proc.stderr
        return dict(re.findall(r"(\w+)=(\S*)", proc.stdout))

    def wait(self, job_id: int, timeout: float = 240) -> dict[str, str]:
        """The job's record once it has finished (any end state)."""
        deadline = time.monotonic() + timeout
        while (info := self.job(job_id))["JobState"] not in FINISHED:
            if time.monotonic() > deadline:
                self.run("scancel", str(job_id))
                raise AssertionError(f"job {job_id} still {info['JobState']} (Reason={info.get('Reason')}) after "
                                     f"{timeout} s\n{self.logs()}")
            time.sleep(0.5)
        return info

    def logs(self, lines: int = 15) -> str:
        """The last lines of each daemon's log, for a failure's message."""
        log_dir = os.path.join(self.state_dir, "log")
        parts = []
        for name in sorted(os.listdir(log_dir)) if os.path.isdir(log_dir) else []:
            with open(os.path.join(log_dir, name), errors="replace") as f:
                parts.append(f"--- {name}\n" + "".join(f.readlines()[-lines:]))
        return "\n".join(parts)

    def cancel_all(self) -> None:
        self.run("scancel", "--user", "root", "--full", "--signal", "KILL")
        self.run("scancel", "--user", "root")


@contextmanager
def private_slurm(netns: tuple[str, str] | None = None) -> Iterator[SlurmCluster]:
    """Install (if needed), start, yield the cluster; stop every daemon and remove its state afterwards, whatever
    happened. With `netns`, two nodes node0 and node1 (10.77.0.1 and 10.77.0.2), one slurmd in each of these
    network namespaces (see the setup script's start-netns for what they must have). One cluster at a time on
    the machine (a file lock). The state lives in a short directory of its own under /tmp: slurmd makes unix
    sockets under it (spool/NODE/NODE_JOB.STEP), and a pytest-xdist tmp_path made that path longer than the
    108 bytes a socket path may have, so the batch step could not start and the job went back to PENDING."""
    with exclusive("slurm"):
        state_dir = tempfile.mkdtemp(prefix="rlhf-slurm-", dir="/tmp")
        try:
            yield from _private_slurm(state_dir, netns)
        finally:
            shutil.rmtree(state_dir, ignore_errors=True)


def _private_slurm(state_dir: str, netns: tuple[str, str] | None) -> Iterator[SlurmCluster]:
    _setup("install")
    if netns is None:
        cluster, start = SlurmCluster(state_dir), ("start", state_dir, str(_free_port_pair()))
    else:
        cluster = SlurmCluster(state_dir, ("nsenter", f"--net=/run/netns/{netns[0]}"))
        start = ("start-netns", state_dir, str(_free_port_pair()), *netns)
    try:
        _setup(*start)
        yield cluster
    finally:
        try:
            cluster.cancel_all()
            time.sleep(1)
        finally:
            subprocess.run(["bash", SETUP, "stop", state_dir], timeout=60)
