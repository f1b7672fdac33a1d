"""rlhf.cli.warm_start: a worker forked from the launcher starts as `python -u -m program` would."""

from __future__ import annotations

import ctypes
import json
import os
import random
import signal
import subprocess
import sys

import pytest

from rlhf.cli import warm_start

PROBE = '''
import json, os, random, signal, sys
if sys.argv[1] == "raise":
    raise ValueError("probe failed")
if sys.argv[1] == "interrupt":
    raise KeyboardInterrupt
if sys.argv[1] == "sleep":
    import time
    time.sleep(60)
print(json.dumps({
    "name": __name__, "argv": sys.argv[1:], "env": os.environ.get("PROBE_VALUE"), "home": "HOME" in os.environ,
    "cpus": sorted(os.sched_getaffinity(0)), "fds": sorted(int(f) for f in os.listdir("/proc/self/fd")),
    "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
    "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
    "session": os.getsid(0) == os.getpid(), "random": random.random(),
    "comm": open("/proc/self/comm").read().strip(),
}))
sys.stderr.write("to stderr")
sys.exit(int(sys.argv[1]))
'''


@pytest.fixture()
def probe(tmp_path, monkeypatch):
    (tmp_path / "warm_probe.py").write_text(PROBE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "warm_probe"


def run_probe(tmp_path, program: str, *args: str) -> tuple[int, str, str]:
    out, err = tmp_path / "out", tmp_path / "err"
    with open(out, "w") as o, open(err, "w") as e:
        worker = warm_start.fork_worker(program, list(args), {"PROBE_VALUE": "given"}, o, e)
        code = worker.wait(60)
    return code, out.read_text(), err.read_text()


def test_a_forked_worker_starts_as_a_new_interpreter_would(tmp_path, probe):
    random.seed(0)
    drawn = random.random()
    random.seed(0)
    kept = os.dup2(os.open(os.devnull, os.O_RDONLY), 100)  # a descriptor of the launcher's
    previous = signal.signal(signal.SIGTERM, lambda *_: None)  # a handler of the launcher's
    named = set_thread_name(b"pt_elastic")  # torchrun forks from a thread of that name
    try:
        code, out, err = run_probe(tmp_path, probe, "3", "--flag")
    finally:
        signal.signal(signal.SIGTERM, previous)
        os.close(kept)
        set_thread_name(named)
    seen = json.loads(out)
    assert code == 3
    assert err == "to stderr"
    assert seen["name"] == "__main__" and seen["argv"] == ["3", "--flag"]
    assert seen["env"] == "given" and not seen["home"]  # exactly the environment given
    assert seen["cpus"] == sorted(os.sched_getaffinity(0))
    assert 100 not in seen["fds"] and max(seen["fds"]) <= 3, seen["fds"]  # 0-2, and the listing's own
    assert seen["sigterm"] and seen["sigint"] and seen["session"]
    assert seen["random"] != drawn  # drawn anew, not the launcher's state
    assert seen["comm"] == os.path.basename(sys.executable)[:15]  # what top and ps show, as after an exec


def set_thread_name(name: bytes) -> bytes:
    """Names this thread as the kernel shows it (comm); returns the name it had."""
    with open("/proc/thread-self/comm", "rb") as f:
        before = f.read().strip()
    ctypes.CDLL(None).prctl(warm_start.PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)
    return before


def test_a_forked_worker_ends_as_the_interpreter_would(tmp_path, probe):
    code, _, err = run_probe(tmp_path, probe, "raise")
    assert code == 1 and "ValueError: probe failed" in err and "Traceback" in err
    code, _, err = run_probe(tmp_path, probe, "interrupt")
    assert code == -signal.SIGINT and "KeyboardInterrupt" in err


def test_forked_worker_handle_polls_waits_and_kills(tmp_path, probe):
    with open(tmp_path / "out", "w") as o:
        worker = warm_start.fork_worker(probe, ["sleep"], {}, o, o)
        assert worker.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            worker.wait(0.1)
        worker.kill()
        assert worker.wait(10) == -signal.SIGKILL and worker.poll() == -signal.SIGKILL


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to tell a pinned worker")
def test_a_worker_pinned_by_the_fork_gets_its_parents_cpus_back(tmp_path, probe):
    """Intel OpenMP pins a forked child to one CPU; `become_worker` restores the parent's set."""
    cpus = os.sched_getaffinity(0)
    out = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT)
    pid = os.fork()
    if pid == 0:
        os.sched_setaffinity(0, {min(cpus)})  # as libiomp5's fork handler leaves it
        warm_start.become_worker(probe, ["0"], {}, {1: out}, cpus)
    os.close(out)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert json.loads((tmp_path / "out").read_text())["cpus"] == sorted(cpus)


def test_worker_target_is_torchruns_command_for_the_program():
    program = "rlhf.cli.train_sft"
    assert warm_start.worker_target((sys.executable, "-u", "-m", program, "--a", "1"), program) == ["--a", "1"]
    assert warm_start.worker_target((sys.executable, "-u", "-m", "other"), program) is None
    assert warm_start.worker_target(("numactl", "--cpunodebind=0", sys.executable, "-u", "-m", program), program) \
        is None  # a wrapped command (torchrun's NUMA binding) starts as a new interpreter


def test_warm_modules_are_the_programs_job_and_vllm_where_it_generates_with_it():
    run = warm_start.TRAINING_RUN_MODULES  # a training program's: its schedules and memory plan
    assert warm_start.warm_modules("rlhf.cli.train_sft", []) == ["rlhf.jobs.sft", *run]
    assert warm_start.warm_modules("somewhere.else", []) == []
    assert warm_start.warm_modules("rlhf.cli.train_ppo", ["--pretrain", "x", "--rollout_engine", "hf"]) == \
        ["rlhf.trainers.ppo_run", *run]
    assert warm_start.warm_modules("rlhf.cli.train_ppo", ["--not_a_flag"]) == ["rlhf.trainers.ppo_run", *run]
    assert warm_start.warm_modules("rlhf.cli.train_ppo", []) == \
        ["rlhf.trainers.ppo_run", *warm_start.VLLM_ENGINE_MODULES, *run]
    generate = ["--eval_task", "generate_vllm", "--output_path", "o"]
    assert warm_start.warm_modules("rlhf.cli.batch_inference", generate) == \
        ["rlhf.jobs.inference_run", *warm_start.VLLM_ENGINE_MODULES]


SWALLOWING_IMPORT = '''
import os, signal, time
try:
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while this library imports
    time.sleep(5)
except KeyboardInterrupt:  # as transformers' lazy modules report it
    raise ModuleNotFoundError("Could not import module 'AttentionInterface'") from None
'''


def test_a_ctrl_c_a_library_turns_into_an_import_error_still_ends_the_launch(tmp_path, monkeypatch, capsys):
    """A Ctrl-C while the launcher imports the workers' libraries ends it, even where the library cut by it
    raised an error of its own: not "workers start as new interpreters" and a run that goes on."""
    from rlhf.cli import launch

    (tmp_path / "swallowing_library.py").write_text(SWALLOWING_IMPORT)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(warm_start, "warm_modules", lambda program, args: ["swallowing_library"])
    monkeypatch.setattr(warm_start, "install", lambda program: pytest.fail("workers would be forked"))
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        with launch.sigint_noted() as interrupted:
            launch.warm_start("rlhf.cli.train_sft", [], interrupted)
    assert "workers start as new interpreters" not in capsys.readouterr().err
    assert signal.getsignal(signal.SIGINT) is before  # the handler of before is restored
