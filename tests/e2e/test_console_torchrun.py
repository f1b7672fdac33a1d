"""Under torchrun, a misspelt flag prints one `error:` line first, from rank 0, before torchrun's own banner."""



from tests.distributed import run_torchrun


def error_lines(text):
    return [line for line in text.splitlines() if line.startswith("error:")]


def test_misspelt_flag_under_torchrun_prints_one_line_first():
    proc = run_torchrun(2, "-m rlhf.cli.train_ppo", "--actor_learnig_rate", "1e-6", timeout=300)
    out = proc.stdout + proc.stderr
    assert error_lines(out) == ["error: unknown flag --actor_learnig_rate; did you mean --actor_learning_rate?"]
    assert "usage:" not in out
    assert "exitcode  : 2" in out  # torchrun's banner: rank 0 exited with the usage status ...
    assert out.index("error: unknown flag") < out.index("ChildFailedError")  # ... after our line
