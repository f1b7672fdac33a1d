"""The RePULSe research fork's README commands (tests/repulse_fork_commands.txt) under torchrun: a realistic one stops
at the model load with one error line; a toy one of each method (PPO without KL; REINFORCE, REINFORCE with the reward
transform and RePULSe with KL 10; the base model as proposal without KL), launched as `-m rlhf.cli.train_ppo` (the
fork's module name with the launcher replaced) on 2 ranks, train on the embedded toy with the analytic evaluation
after every fit step (the five in one launch). The step's one prompt's 8 samples are split over both ranks and
micro-batches of 2."""

import functools
import json
import math
from pathlib import Path

import pytest
import torch

from rlhf.assets import TINY_DIR, TOY_BAD_WORDS, TOY_PROMPTS, TOY_REWARD
from tests.distributed import run_job_variants, run_torchrun
from tests.repulse_fork import REALISTIC, TOY, flag_value, set_flag
from tests.tiny_runs import CPU


def test_a_realistic_command_under_torchrun_prints_one_error_line(tmp_path):
    _, argv = next((h, a) for h, a in REALISTIC if h.endswith("/ RePULSe"))
    proc = run_torchrun(1, "-m rlhf.cli.train_ppo", *argv, timeout=300)
    assert proc.returncode != 0
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--pretrain HuggingFaceTB/SmolLM-135M-Instruct: the model must be a local path" \
        in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr.split(errors[0])[0]


SHRINK = {"--micro_train_batch_size": "2", "--train_batch_size": "8", "--duplicate_rollout_batch_by": "8",
          "--fit_steps": "2", "--harmlessness_training_num_episodes": "2", "--prompt_max_len": "8"}
"""The toy's sizes, shrunk: 8 samples per step instead of 500 (micro-batches of 2 per rank: a prompt's group spans
both ranks and 2 micro-batches on each), 2 fit steps of 2 episodes instead of 50 of 5-10, prompts of at most 8
tokens (the tiny policy has 256 positions, distilgpt2 1024)."""


def toy_replay(argv: list[str], out: Path) -> list[str]:
    """`argv` with the embedded toy in place of distilgpt2, the toxicity model and the prompt dataset, the
    output paths under `out`, the sizes of SHRINK (PPO: 2 episodes per fit step) and CPU settings."""
    argv = list(argv)
    set_flag(argv, "--pretrain", f"{TINY_DIR}/policy")
    at = argv.index("--reward_pretrain")
    argv[at:at + 2] = ["--remote_rm_url", TOY_REWARD]  # the toy reward declares its bad words (x y z)
    set_flag(argv, "--prompt_data", TOY_PROMPTS)
    for flag, sub in (("--save_path", "model_out"), ("--ckpt_path", "ckpt"), ("--save_info_path", "info")):
        set_flag(argv, flag, str(out / sub))
    for flag, value in SHRINK.items():
        if flag in argv:
            set_flag(argv, flag, value)
    if "--do_harmlessness_training" not in argv:
        set_flag(argv, "--num_episodes", "2")
    return [*argv, *CPU, "--rollout_engine", "hf"]


@functools.cache
def _exact_log_p_bad_of_the_tiny_policy() -> float:
    from rlhf.models.loading import load_causal_lm, load_tokenizer
    from rlhf.repulse.bad_outputs import log_p_bad, next_token_logprobs_V, second_token_logprobs_VV
    from rlhf.repulse.repulse_eval import bad_token_ids

    tok = load_tokenizer(f"{TINY_DIR}/policy")
    model = load_causal_lm(f"{TINY_DIR}/policy", torch.float32, "sdpa").eval()
    ids = tok(json.loads(Path(TOY_PROMPTS).read_text())["prompt"], add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        first = next_token_logprobs_V(model, torch.tensor([ids]))[0]
        second = second_token_logprobs_VV(model, ids, first.shape[0])
    return float(log_p_bad(first, second, bad_token_ids(TOY_BAD_WORDS, tok), tok.eos_token_id))


def _toy_id(index: int, heading: str, argv: list[str]) -> str:
    method = heading.rsplit(" / ", 1)[1].replace("REINFORCE with reward transformation", "transformed")
    return f"{index}-kl{flag_value(argv, '--init_kl_coef')}-{method.replace(' ', '_')}"


# One of the ten toy commands per method: PPO (with a critic) and the base model as proposal without KL,
# REINFORCE, REINFORCE with the reward transform and RePULSe with KL 10. Every command parses into what it means
# (tests/unit/test_repulse_fork_commands.py).
REPLAYED = [0, 5, 6, 3, 8]


@pytest.fixture(scope="module")
def replays(tmp_path_factory) -> dict[int, tuple[Path, str]]:
    """The replayed toy commands, one after another in one 2-rank launch (`run_job_variants`), each
    under `rlhf.cli.train_ppo`, the module name the rule "replace the launcher" gives for the fork's
    openrlhf.cli.train_ppo: {index: (its output directory, its console output)}."""
    tmp = tmp_path_factory.mktemp("fork_toy")
    runs = {i: tmp / str(i) for i in REPLAYED}
    outputs = run_job_variants(2, [("train_ppo", toy_replay(TOY[i][1], out)) for i, out in runs.items()],
                               tmp / "consoles", timeout=1500)
    return {i: (out, text) for (i, out), text in zip(runs.items(), outputs)}


@pytest.mark.parametrize("index", REPLAYED, ids=[_toy_id(i, *TOY[i]) for i in REPLAYED])
def test_toy_command_trains_on_the_embedded_toy(index, replays):
    heading = TOY[index][0]
    run, stdout = replays[index]
    assert stdout.count("running this command as python -m rlhf.cli.train_repulse") == 1
    out = run / "model_out"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    evals = [r for r in rows if "log_p_bad" in r]
    steps_per_fit = 2  # one prompt per step: 2 episodes of 1 step
    assert [r["step"] for r in evals] == [0, steps_per_fit, 2 * steps_per_fit]
    # before any update every method evaluates the same tiny policy exactly
    assert evals[0]["log_p_bad"] == pytest.approx(_exact_log_p_bad_of_the_tiny_policy(), abs=1e-5)
    assert all(math.isfinite(r["log_p_bad"]) and -5 <= r["reward_mean"] <= 1 for r in evals)
    info = [json.loads(line) for line in (run / "info" / "evaluations.jsonl").open()]
    assert [r["log_p_bad"] for r in info] == [r["log_p_bad"] for r in evals]
    assert evals[-1]["samples_drawn"] == 8 * 2 * steps_per_fit * (2 if heading.endswith("/ RePULSe") else 1)
    assert evals[-1]["log_p_bad"] != evals[0]["log_p_bad"]  # the policy was trained
    assert (out / "model" / "config.json").exists()
    assert (out / "proposal").exists() == heading.endswith("/ RePULSe")
    assert "analytic evaluation after every fit step: exact log P(bad) of 2-token responses to 'copy :', " \
           "bad words 'x y z'" in stdout


def test_gcg_goals_split_over_ranks_give_the_one_process_result(tmp_path):
    """`torchrun --nproc_per_node 2 -m rlhf.cli.evaluate_gcg_sz` (the fork's module name; the fork launches it with
    deepspeed on every GPU): the ranks split the goals and rank 0 writes the file one process writes."""
    from tests.tiny_runs import run_gcg_cli

    small = ["--max_targets", "3", "--gcg_steps", "1", "--gcg_search_width", "8", "--gcg_suffix_len", "6",
             "--samples_per_goal", "3", "--max_new_tokens", "6"]
    run_gcg_cli([*small, "--save_path", str(tmp_path / "one")])
    proc = run_torchrun(2, "-m rlhf.cli.evaluate_gcg_sz", *small, "--save_path", str(tmp_path / "two"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert proc.stdout.count("attack success rate") == 1 and "goals split over 2 ranks" in proc.stdout
    one, two = (json.loads((tmp_path / name / "gcg.json").read_text()) for name in ("one", "two"))
    assert one["num_goals"] == 3 and two == one
