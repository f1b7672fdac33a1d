"""What a user sees on the console: usage errors as one short line from rank 0 (exit 2), other errors with their
traceback, and third-party library warnings once (all of them in the run's log file)."""

import json
import logging
import os
import sys
import warnings

import pytest
import torch

import rlhf
import rlhf.cli.train_ppo as train_ppo
import rlhf.trainers.ppo_run as ppo_run
from rlhf.config import errors
from rlhf.config.errors import UsageError, usage_errors_exit
from rlhf.config.flags import parse_config
from rlhf.config.ppo_config import TrainPPOConfig
from rlhf.config.shared_config import LoggingConfig
from rlhf.core.run import show_parse_warnings
from rlhf.distributed.launch_env import read_launch_env
from rlhf.utils.console import KNOWN_NOTICES, known_notice, native_output_routed, route_library_output

TORCH_FILE = os.path.join(os.path.dirname(torch.__file__), "fake_module.py")
RLHF_FILE = os.path.join(os.path.dirname(rlhf.__file__), "fake_module.py")


@pytest.fixture
def single_process(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(errors, "RANK0_GRACE_S", 0.0)
    return monkeypatch


def error_lines(text):
    return [line for line in text.splitlines() if line.startswith("error:")]


@pytest.mark.parametrize("argv,line", [
    (["--actor_learnig_rate", "1e-6"], "error: unknown flag --actor_learnig_rate; did you mean --actor_learning_rate?"),
    (["--seed", "abc"], "error: --seed 'abc' is not an integer; give one, e.g. --seed 42"),
    (["--adam_betas", "0.9"], "error: --adam_betas takes 2 values, e.g. --adam_betas 0.9 0.95"),
    (["--zero_stage", "4"], "error: --zero_stage 4: choose 0, 1, 2 or 3"),
    (["--init_kl_coef", "-1e-3"], "error: --init_kl_coef takes a value, and -1e-3 reads as a flag: write "
                                     "--init_kl_coef=-1e-3"),
])
def test_usage_errors_are_one_line_on_rank0(single_process, capsys, argv, line):
    single_process.setenv("RANK", "0")
    with pytest.raises(SystemExit) as exc:
        train_ppo.main(argv)
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert error_lines(captured.err) == [line] and captured.out == ""
    assert "usage:" not in captured.err and "Traceback" not in captured.err


def test_one_line_per_problem(single_process, capsys):
    with pytest.raises(SystemExit):
        train_ppo.main(["--actor_learnig_rate", "1", "--no_such_flag"])
    assert error_lines(capsys.readouterr().err) == [
        "error: unknown flag --actor_learnig_rate; did you mean --actor_learning_rate?",
        "error: unknown flag --no_such_flag; see --help"]


def test_other_ranks_report_only_what_rank0_did_not(single_process, capsys):
    single_process.setenv("RANK", "1")
    with pytest.raises(SystemExit) as exc:
        train_ppo.main(["--zero_stage", "4"])
    assert exc.value.code == 2
    # Under torchrun rank 0's exit stops this rank during the grace period (RANK0_GRACE_S, 0 here).
    assert error_lines(capsys.readouterr().err) == ["error: [rank 1] --zero_stage 4: choose 0, 1, 2 or 3"]


def test_help_is_still_full(single_process, capsys):
    with pytest.raises(SystemExit) as exc:
        train_ppo.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:") and "--verbose" in out and "--actor_learning_rate" in out


def test_input_checks_before_start_are_usage_errors(single_process, capsys):
    def bad_launch():
        read_launch_env({"RANK": "0", "WORLD_SIZE": "2"})  # a ValueError raised by rlhf code

    with pytest.raises(SystemExit) as exc, usage_errors_exit(started=lambda: False):
        bad_launch()
    assert exc.value.code == 2
    assert error_lines(capsys.readouterr().err) == [
        "error: RANK/WORLD_SIZE are set but MASTER_ADDR, MASTER_PORT are not: start with torchrun, or export them"]
    with pytest.raises(ValueError, match="MASTER_ADDR"), usage_errors_exit(started=lambda: True):
        bad_launch()  # after start: not a usage error, the traceback stays


def test_library_value_error_keeps_its_traceback(single_process, capsys):
    def run(cfg, parse_warnings=()):
        json.loads("{")  # a ValueError raised inside a library

    single_process.setattr(ppo_run, "run", run)
    with pytest.raises(json.JSONDecodeError):
        train_ppo.main([])
    assert capsys.readouterr().err == ""


def test_errors_after_start_keep_their_traceback_but_usage_errors_do_not(single_process, capsys):
    def run(cfg, parse_warnings=()):
        raise ValueError("reward_func returned 1 rewards for 3 queries")

    single_process.setattr(ppo_run, "run", run)
    single_process.setattr(torch.distributed, "is_initialized", lambda: True)
    with pytest.raises(ValueError, match="returned 1 rewards"):
        train_ppo.main([])

    def run_usage(cfg, parse_warnings=()):
        raise UsageError("--vllm_tensor_parallel_size 2 needs vLLM")

    single_process.setattr(ppo_run, "run", run_usage)
    single_process.setenv("RANK", "1")
    with pytest.raises(SystemExit):
        train_ppo.main([])
    assert error_lines(capsys.readouterr().err) == ["error: [rank 1] --vllm_tensor_parallel_size 2 needs vLLM"]


@pytest.fixture
def library_logger(monkeypatch):
    """A library-style logger with its own console handler (as DeepSpeed and transformers set up);
    call it inside the test, so that the handler writes to the captured stderr."""
    monkeypatch.delenv("VLLM_CONFIGURE_LOGGING", raising=False)  # route_library_output sets it
    logger = logging.getLogger("accelerate.fake_module")

    def make():
        logger.addHandler(logging.StreamHandler(sys.stderr))
        logger.propagate = False
        return logger

    yield make
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    logger.propagate = True


def warn_from(filename, message, times=1, category=FutureWarning):
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        for _ in range(times):
            warnings.warn_explicit(message, category, filename, 1)


def show_on_file(message, category, filename, lineno, file=None, line=None):
    """Python's way of showing a warning, minus the source line (pytest records warnings instead)."""
    (sys.stderr if file is None else file).write(f"{filename}:{lineno}: {category.__name__}: {message}\n")


def test_library_output_once_on_console_all_in_file(tmp_path, capsys, monkeypatch, library_logger):
    """Each distinct library warning once on the console, every one in the file; the notices that ask nothing of
    the user (a deprecation inside a library, `KNOWN_NOTICES`: here vLLM's CPU-build Triton note and torch's
    native NUMA line) only in the file, with one console line, the first time, saying where they go."""
    library_logger = library_logger()
    monkeypatch.setattr(warnings, "showwarning", show_on_file)
    routing = route_library_output(LoggingConfig(save_path=str(tmp_path)), rank=0)
    numa = ("[W1201 08:00:00.000000000 utils.cpp:120] Warning: NUMA binding: Using MEMBIND policy for memory "
            "allocation on the NUMA nodes (0). Memory allocations will be strictly bound to these NUMA nodes. "
            "(function operator())\n")
    try:
        assert os.environ["VLLM_CONFIGURE_LOGGING"] == "0"
        for _ in range(5):
            library_logger.warning("same thing again")
            logging.getLogger("vllm.worker.cpu_worker").warning("cpu worker noise")
            logging.getLogger("vllm.triton_utils").warning(
                "Triton is installed, but doesn't include CPU backend. Disabling Triton.")
        warn_from(TORCH_FILE, "deprecated op", times=5)
        warn_from(TORCH_FILE, "odd input", times=5, category=UserWarning)
        warn_from(RLHF_FILE, "our own warning")
        routing.replay_native(numa)
        exec(compile("print('a library print')", TORCH_FILE, "exec"))
        print("our own print")
    finally:
        routing.uninstall()
    path = tmp_path / "logs" / "rank0.log"
    captured = capsys.readouterr()
    assert captured.out == "our own print\n"
    suffix = f" (repeats are logged to {path})"
    assert [line for line in captured.err.splitlines() if "our own warning" not in line] == [
        "[accelerate] WARNING: same thing again" + suffix,
        "[vllm] WARNING: cpu worker noise" + suffix,
        "[libraries] notices that ask nothing of you (deprecations inside the libraries, vLLM's CPU-build notes: "
        f"rlhf.utils.console) are logged to {path} only; --verbose shows them",
        "[torch] UserWarning: odd input" + suffix,
    ]
    assert "FutureWarning: our own warning\n" in captured.err and RLHF_FILE not in captured.err
    logged = path.read_text()
    assert logged.count("same thing again") == 5 and logged.count("cpu worker noise") == 5
    assert logged.count("deprecated op") == 5 and logged.count("odd input") == 5 and "a library print" in logged
    assert logged.count("Disabling Triton") == 5 and logged.count("MEMBIND") == 1
    assert "our own" not in logged


def test_every_known_notice_matches_the_text_the_libraries_print():
    """Each pattern of KNOWN_NOTICES against the line as vLLM 0.32 and torch 2.13 print it (copied from a run's
    console); a message merely near one (another library, another notice) stays shown."""
    printed = [
        ("vllm", "Triton is installed, but doesn't include CPU backend. Disabling Triton."),
        ("vllm", "Triton is not installed. triton-cpu is expected on x86 CPUs."),
        ("vllm", "Model Runner V2 requires Triton; using the V1 model runner instead."),
        ("vllm", "The global random seed is set to 42. Since VLLM_ENABLE_V1_MULTIPROCESSING is set to False, this "
                 "may affect the random state of the Python process that launched vLLM."),
        ("vllm", "Enforce eager set, disabling torch.compile, CUDAGraphs, and JIT kernel warmup. This is equivalent "
                 "to setting -cc.mode=none -cc.cudagraph_mode=none and --kernel_config.enable_jit_warmup=False"),
        ("vllm", "Inductor compilation was disabled by user settings, optimizations settings that are only active "
                 "during inductor compilation will be ignored."),
        ("vllm", "CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding, skip it."),
        ("torch", "NUMA binding: Using MEMBIND policy for memory allocation on the NUMA nodes (0). Memory "
                  "allocations will be strictly bound to these NUMA nodes."),
        ("vllm", "Reset SSM cache type to float32 for accelerated GDN mamba backend 'none'."),
    ]
    assert [known_notice(library, message) for library, message in printed] == [True] * len(printed)
    assert len(KNOWN_NOTICES) == 6 and all(any(p.search(m) for _, m in printed) for _, p in KNOWN_NOTICES)
    assert not known_notice("torch", printed[0][1])
    assert not known_notice("vllm", "Not enough KV cache blocks: the model cannot run at max_model_len 4096")
    # a model with Mamba layers whose backend is not the accelerated one: shown
    assert not known_notice("vllm", "Reset SSM cache type to float32 for accelerated GDN mamba backend 'mamba2'.")


def test_library_warning_does_not_land_inside_a_progress_bar(tmp_path, capsys, library_logger):
    library_logger = library_logger()
    routing = route_library_output(LoggingConfig(save_path=str(tmp_path)), rank=0)
    try:
        sys.stderr.write("\rrl steps:  50%|#####")  # a bar leaves its line open
        library_logger.warning("mid-step noise")
        sys.stderr.write("\rrl steps: 100%|##########")
    finally:
        routing.uninstall()
    assert capsys.readouterr().err.startswith("\rrl steps:  50%|#####\n[accelerate] WARNING: mid-step noise (")


def test_config_notes_are_shown_once_from_rank0_without_a_location(capsys):
    with warnings.catch_warnings(record=True) as parse_warnings:
        warnings.simplefilter("default")
        parse_config(TrainPPOConfig, ["--use_dynamic_batch"])
    show_parse_warnings(parse_warnings, rank=1)
    assert capsys.readouterr().err == ""
    show_parse_warnings(parse_warnings, rank=0)
    assert capsys.readouterr().err == ("UserWarning: --use_dynamic_batch works on packed sequences: turning on "
                                       "--packing_samples\n")


def test_an_unwritable_log_directory_never_prints_a_logging_traceback(tmp_path, capsys, library_logger):
    """--save_path under a file: library output reaches the console as it is (the job's checks then print
    the `error:` line), not logging's "--- Logging error ---" tracebacks."""
    library_logger = library_logger()
    blocker = tmp_path / "file"
    blocker.write_text("")
    routing = route_library_output(LoggingConfig(save_path=str(blocker / "out")), rank=0)
    try:
        library_logger.warning("noise before the checks")
    finally:
        routing.uninstall()
    err = capsys.readouterr().err
    assert "noise before the checks" in err
    assert "Traceback" not in err and "Logging error" not in err


def test_other_ranks_show_no_library_output(tmp_path, capsys, library_logger):
    library_logger = library_logger()
    routing = route_library_output(LoggingConfig(save_path=str(tmp_path)), rank=1)
    try:
        library_logger.warning("rank 1 noise")
    finally:
        routing.uninstall()
    assert capsys.readouterr().err == ""
    assert "rank 1 noise" in (tmp_path / "logs" / "rank1.log").read_text()


def test_uncaught_errors_reach_the_console_on_every_rank(tmp_path, capsys):
    """A failing non-zero rank's traceback is shown (prefixed with its rank), not only logged."""
    routing = route_library_output(LoggingConfig(save_path=str(tmp_path)), rank=1)
    try:
        try:
            raise TimeoutError("reward_func in r.py did not return within 4 s")
        except TimeoutError as err:
            sys.excepthook(type(err), err, err.__traceback__)
    finally:
        routing.uninstall()
    err = capsys.readouterr().err
    assert "[rank 1] TimeoutError: reward_func in r.py did not return within 4 s" in err
    assert "did not return within 4 s" in (tmp_path / "logs" / "rank1.log").read_text()
    assert sys.excepthook is sys.__excepthook__


def test_verbose_passes_everything_through(tmp_path, capsys, monkeypatch, library_logger):
    library_logger = library_logger()
    monkeypatch.setattr(warnings, "showwarning", show_on_file)
    assert route_library_output(LoggingConfig(save_path=str(tmp_path), verbose=True), rank=0) is None
    for _ in range(5):
        library_logger.warning("same thing again")
    warn_from(TORCH_FILE, "deprecated op", times=5)
    err = capsys.readouterr().err
    assert err.count("same thing again") == 5 and err.count("FutureWarning: deprecated op") == 5
    assert "repeats are logged" not in err and not (tmp_path / "logs").exists()
    assert "VLLM_CONFIGURE_LOGGING" not in os.environ


def test_an_unwritable_save_path_is_the_first_line_shown(single_process, capsys, tmp_path):
    """The outputs are checked before the flags' notes and the machine's choices are shown, so a run that
    cannot write its outputs says so first (here after a note: --eval_steps without --eval_dataset)."""
    from rlhf.cli import train_sft
    from rlhf.utils import console

    blocker = tmp_path / "file"
    blocker.write_text("")
    try:
        with pytest.raises(SystemExit) as exc:
            train_sft.main(["--save_path", str(blocker / "out"), "--eval_steps", "2", "--max_steps", "1"])
    finally:
        if console._active is not None:
            console._active.uninstall()
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[0].startswith(f"error: --save_path {blocker}/out is not writable"), err


def _python(code: str, timeout: int, **env: str):
    """`python -c code` from the repository root, its output captured."""
    import subprocess

    from tests.distributed import ROOT

    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": ROOT, **env})


def test_a_refused_command_never_imports_torch():
    """Every job answers a mistyped flag before torch (let alone transformers, DeepSpeed, vLLM) is imported:
    `benchmarks/refusal_latency.py` measures the time this saves."""
    from rlhf.config.jobs import JOBS

    code = ("import sys\n"
            f"for job in {[job.name for job in JOBS]!r}:\n"
            "    module = __import__(f'rlhf.cli.{job}', fromlist=['main'])\n"
            "    try:\n"
            "        module.main(['--no_such_flag'])\n"
            "    except SystemExit as exit:\n"
            "        assert exit.code == 2, (job, exit.code)\n"
            "heavy = ('torch', 'transformers', 'deepspeed', 'vllm')\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n")
    proc = _python(code, 120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]"
    assert proc.stderr.count("error: unknown flag --no_such_flag") == len(JOBS)


def test_end_program_does_what_finalization_would_and_exits_0(tmp_path):
    """`end_program` skips the interpreter's finalization but not what it does that matters: a non-daemon
    thread finishes, atexit handlers run after it (newest first), unflushed output reaches the streams, and the
    exit status is 0."""
    code = ("import atexit, sys, threading, time\n"
            "from rlhf.cli.entry_point import end_program\n"
            f"log = open({str(tmp_path / 'order.txt')!r}, 'w')\n"
            "atexit.register(lambda: (log.write('older handler\\n'), log.close()))\n"
            "atexit.register(lambda: log.write('newer handler\\n'))\n"
            "threading.Thread(target=lambda: (time.sleep(0.3), log.write('thread\\n'))).start()\n"
            "sys.stdout.write('unflushed stdout')\n"
            "sys.stderr.write('unflushed stderr')\n"
            "end_program()\n"
            "print('never reached')\n")
    proc = _python(code, 60, PYTHONUNBUFFERED="")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (proc.stdout, proc.stderr) == ("unflushed stdout", "unflushed stderr")
    assert (tmp_path / "order.txt").read_text() == "thread\nnewer handler\nolder handler\n"


def test_freeze_heap_freezes_now_and_unfreezes_at_exit():
    """`freeze_heap` takes every object alive out of the collector's walks, and the first call registers one
    unfreeze at exit (a normal finalization then frees them as usual)."""
    code = ("import atexit, gc\n"
            "from rlhf.utils.heap import freeze_heap\n"
            "before = gc.get_freeze_count()\n"
            "freeze_heap()\n"
            "first = gc.get_freeze_count()\n"
            "extra = [[] for _ in range(1000)]\n"
            "freeze_heap()\n"
            "second = gc.get_freeze_count()\n"
            "atexit._run_exitfuncs()\n"
            "print(before, first > 1000, second - first >= 1000, gc.get_freeze_count())\n")
    proc = _python(code, 60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["0", "True", "True", "0"]


def test_native_warnings_in_a_routed_block_are_shown_once_and_logged(tmp_path, capfd):
    """C++ writes to file descriptor 2 inside `native_output_routed` (vLLM's NUMA-binding warning at engine
    start-up): torch's warning lines go to the log file and once to rank 0's console; any other stderr output of
    the block (a progress bar, say) is shown as written. Outside a block, and without routing, nothing changes."""
    warning = "[rank0]:[W1129 04:43:58.131542475 utils.cpp:68] Warning: NUMA binding: MEMBIND on nodes (0). " \
              "(function init_cpu_memory_env)\n"
    with native_output_routed():  # no routing installed: passes through
        os.write(2, b"unrouted\n")
    routing = route_library_output(LoggingConfig(save_path=str(tmp_path)), rank=0)
    try:
        with native_output_routed():
            os.write(2, warning.encode())
            os.write(2, b"native progress 1/2\n")
            os.write(2, warning.replace("[rank0]:", "").replace("04:43:58", "04:44:01").encode())
        os.write(2, b"after the block\n")
    finally:
        routing.uninstall()
    path = tmp_path / "logs" / "rank0.log"
    assert capfd.readouterr().err == (
        "unrouted\n"
        f"[torch] WARNING: NUMA binding: MEMBIND on nodes (0). (repeats are logged to {path})\n"
        "native progress 1/2\nafter the block\n")
    assert path.read_text().count("Warning: NUMA binding: MEMBIND on nodes (0).") == 2
