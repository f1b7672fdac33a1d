"""A launcher for the tests of the example scripts that starts ranks as forks of a preloaded interpreter.

The launcher (`rlhf.cli.launch`, torchrun) starts fresh interpreters that import torch, transformers, DeepSpeed and
vLLM again, 10-25 CPU-seconds per rank on 2 CPU cores: a third of a 4-rank example's two minutes, and most of each
short stage of the pipelines (rejection sampling, conditional SFT, the InstructGPT pipeline: 3 to 10 launches).
Within `serving()` (tests/examples/conftest.py), RLHF_TEST_LAUNCH_SOCKET is set and `launch/examples/common.sh`
sends each launch to this server instead (`python -m tests.launch_server --client ...`, which imports nothing
heavy): the server, which imported `tests.distributed.PRELOAD` once, forks the launch's ranks with the environment
a launcher gives them (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, and LD_PRELOAD as
`rlhf.cli.launch` sets it, loaded since the server's start), the client's working directory, environment and
standard streams, and what `rlhf.cli.warm_start.become_worker` gives a forked worker (as the product's launcher
forks its own: the server's CPU affinity, OMP_NUM_THREADS applied to torch, default signal handlers, fresh random
state), and returns the worst exit code. Like torchrun, a rank that fails ends the others. The quickstart (the
README's first command, its own launch line) keeps the real launcher, and so do the e2e tests of the launcher itself
(signals, grace periods, restarts: tests/e2e/test_preemption.py, test_hangs_launcher.py, test_slurm.py).

    python -m tests.launch_server SOCKET              # serve (until killed)
    python -m tests.launch_server --client [launcher flags] -m MODULE [args...]   # one stage, as rlhf.cli.launch
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator

ENV_SOCKET = "RLHF_TEST_LAUNCH_SOCKET"
FAILED_RANK_GRACE_S = 5.0
"""After a rank fails, how long the others may take to end on their own before they are killed (torchrun stops
them at once; the product's heartbeat would name the dead peer within --dist_timeout)."""


def parse_launch(argv: list[str]) -> tuple[int, str, int, str, list[str]]:
    """(nproc, master address, master port, module, its args) of `rlhf.cli.launch`'s flags as the examples use
    them: --nproc_per_node N --master_addr A --master_port P -m MODULE ARGS."""
    nproc, addr, port = 1, "127.0.0.1", 29500
    i = 0
    while i < len(argv) and argv[i] != "-m":
        flag, value = argv[i], argv[i + 1]
        if flag == "--nproc_per_node":
            nproc = int(value)
        elif flag == "--master_addr":
            addr = value
        elif flag == "--master_port":
            port = int(value)
        else:
            raise SystemExit(f"tests.launch_server: launcher flag {flag} is not supported here (only --nproc_per_node, "
                             "--master_addr, --master_port)")
        i += 2
    if i + 1 >= len(argv):
        raise SystemExit("tests.launch_server: no -m MODULE")
    return nproc, addr, port, argv[i + 1], argv[i + 2:]


def _rank(fds: list[int], request: dict, rank: int) -> None:
    """The body of a forked rank: the client's streams, directory and environment, then the module as __main__
    (`rlhf.cli.warm_start.become_worker`: what a new interpreter would have)."""
    from rlhf.cli.warm_start import become_worker

    os.chdir(request["cwd"])
    nproc, addr, port, module, args = parse_launch(request["argv"])
    env = {**request["env"], "RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(rank),
           "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": addr, "MASTER_PORT": str(port),
           "LD_PRELOAD": request["ld_preload"]}
    become_worker(module, args, env, dict(enumerate(fds)), request["cpus"])


def _session(conn: socket.socket, ld_preload: str, cpus: set[int]) -> None:
    """One stage: fork its ranks, wait for them (ending the rest when one fails or the client goes away), answer
    with the worst exit code."""
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    request = dict(json.loads(data.decode()), ld_preload=ld_preload, cpus=cpus)
    nproc = parse_launch(request["argv"])[0]
    pids = []
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            conn.close()
            _rank(fds, request, rank)
        pids.append(pid)
    for fd in fds:
        os.close(fd)
    codes: dict[int, int] = {}
    failed_at = None
    conn.setblocking(False)
    while len(codes) < nproc:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            codes[pid] = os.waitstatus_to_exitcode(status)
            if codes[pid] != 0 and failed_at is None:
                failed_at = time.monotonic()
            continue
        try:
            gone = conn.recv(1) == b""
        except BlockingIOError:
            gone = False
        late = failed_at is not None and time.monotonic() - failed_at > FAILED_RANK_GRACE_S
        if gone or late:
            for p in pids:
                if p not in codes:
                    os.kill(p, signal.SIGKILL)
        time.sleep(0.05)
    worst = max(codes.values(), key=lambda c: (c != 0, abs(c)))
    conn.setblocking(True)
    try:
        conn.sendall(json.dumps({"exit_code": worst}).encode())
    except OSError:
        pass


def serve(path: str) -> None:
    """Preload, then serve stages until killed: each connection in a forked session process. Start it with the
    LD_PRELOAD the ranks should have (`preload_env`): a fork keeps the libraries its parent loaded."""
    import importlib

    from tests.distributed import PRELOAD

    for name in PRELOAD:
        importlib.import_module(name)
    ld_preload = os.environ.get("LD_PRELOAD", "")
    cpus = os.sched_getaffinity(0)  # before the libraries start threads
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    print("ready", flush=True)
    while True:
        conn, _ = server.accept()
        if os.fork() == 0:
            server.close()
            _session(conn, ld_preload, cpus)
            os._exit(0)
        conn.close()
        while True:  # reap finished sessions
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break


def preload_env() -> dict[str, str]:
    """This environment with LD_PRELOAD as `rlhf.cli.launch` gives its workers (tcmalloc and libiomp5 where
    installed)."""
    from rlhf.utils.preload import cpu_preload, search_dirs

    preload, _ = cpu_preload(os.environ.get("LD_PRELOAD", ""), search_dirs())
    return {**os.environ, "LD_PRELOAD": preload}


@contextlib.contextmanager
def serving() -> Iterator[str]:
    """A server for this test process's example scripts: RLHF_TEST_LAUNCH_SOCKET points at it while the block runs
    (scripts started from here inherit it)."""
    import subprocess
    import tempfile

    from tests.distributed import ROOT

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "launch.sock")
        # one OpenMP thread per rank, as the scripts and torchrun give several ranks on one machine
        server = subprocess.Popen([sys.executable, "-m", "tests.launch_server", path], cwd=ROOT, text=True,
                                  stdout=subprocess.PIPE,
                                  env={"OMP_NUM_THREADS": "1", **preload_env(), "PYTHONPATH": ROOT})
        try:
            assert server.stdout.readline().strip() == "ready", "tests.launch_server did not start"
            os.environ[ENV_SOCKET] = path
            yield path
        finally:
            os.environ.pop(ENV_SOCKET, None)
            server.kill()
            server.wait()


def client(argv: list[str]) -> int:
    """Send one stage to the server at $RLHF_TEST_LAUNCH_SOCKET with this process's streams; its exit code."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(os.environ[ENV_SOCKET])
    request = {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}
    socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
    reply = b""
    while chunk := conn.recv(4096):
        reply += chunk
    return json.loads(reply.decode())["exit_code"] if reply else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--client"]:
        sys.exit(client(sys.argv[2:]))
    serve(sys.argv[1])
