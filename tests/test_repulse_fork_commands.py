"""The commands of the RePULSe research fork's README (tests/repulse_fork_commands.txt, verbatim) replayed
after changing the launcher: every one parses; the toy ones (Sec 4.2: PPO, REINFORCE, reward-transformed
REINFORCE, base-as-proposal, RePULSe; KL 0 and 10) train under torchrun with the model, reward and prompt
paths replaced by the embedded toy assets and sizes shrunk, with the analytic evaluation after every fit
step; the realistic ones (Sec 4.3) and the GCG evaluation stop at the model load with an error saying the
model must be a local path (nothing is downloaded here)."""

import json
import math
import shlex
from pathlib import Path

import pytest
import torch

from rlhf.assets import TINY_DIR, TOY_BAD_WORDS, TOY_PROMPTS, TOY_REWARD
from rlhf.cli.common import for_this_machine
from rlhf.config.errors import UsageError
from rlhf.config.flags import parse_config
from rlhf.config.gcg import EvaluateGCGConfig
from rlhf.config.ppo import TrainPPOConfig
from tests.distributed import run_torchrun
from tests.test_e2e import CPU

COMMANDS = Path(__file__).with_name("repulse_fork_commands.txt")


def fork_commands() -> list[tuple[str, str, list[str]]]:
    """(heading, module, argv after `--module MODULE`) of every command in the file."""
    out, heading = [], None
    for line in COMMANDS.read_text().splitlines():
        if line.startswith("## "):
            heading = line[3:]
        elif line and not line.startswith("#"):
            tokens = shlex.split(line)
            at = tokens.index("--module")
            out.append((heading, tokens[at + 1], tokens[at + 2:]))
    return out


COMMAND_LIST = fork_commands()
TRAIN = [(h, argv) for h, module, argv in COMMAND_LIST if module == "openrlhf.cli.train_ppo"]
TOY = [(h, argv) for h, argv in TRAIN if h.startswith("Toy")]
REALISTIC = [(h, argv) for h, argv in TRAIN if not h.startswith("Toy")]
GCG = [argv for _, module, argv in COMMAND_LIST if module.startswith("openrlhf.cli.evaluate_gcg")]


def _value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def _set(argv: list[str], flag: str, value: str) -> None:
    argv[argv.index(flag) + 1] = value


def test_the_file_holds_the_forks_commands():
    assert (len(TOY), len(REALISTIC), len(GCG)) == (10, 21, 1)
    methods = {h.rsplit(" / ", 1)[1] for h, _ in TOY}
    assert methods == {"PPO", "REINFORCE", "REINFORCE with reward transformation", "Base model proposal", "RePULSe"}


@pytest.mark.parametrize("heading,argv", TRAIN, ids=[f"{i}" for i in range(len(TRAIN))])
def test_every_train_command_parses_into_what_it_means(heading, argv):
    cfg = parse_config(TrainPPOConfig, argv)
    rp = cfg.repulse
    method = heading.rsplit(" / ", 1)[1]
    assert rp.do_harmlessness_training == (method != "PPO")
    assert cfg.samples_per_prompt == int(_value(argv, "--duplicate_rollout_batch_by"))
    assert cfg.batch.rollout_batch_size * cfg.samples_per_prompt % cfg.batch.train_batch_size == 0
    if method == "PPO":
        assert cfg.uses_critic and cfg.optim.critic_learning_rate == float(_value(argv, "--critic_learning_rate"))
        assert cfg.batch.num_episodes == int(_value(argv, "--num_episodes"))
    elif method == "RePULSe":
        assert rp.uses_proposal and rp.actor_loss_type == "ctl" and rp.alpha > 0
        assert cfg.optim.actor_learning_rate > 0 and rp.base_actor_learning_rate > 0
    elif method == "Base model proposal":
        assert rp.negatives_used and not rp.uses_proposal
    else:  # REINFORCE, with or without the transform
        assert rp.harmlessness_training_loss_type == "reinforce" and not rp.uses_proposal
        assert (rp.reward_transform == "minus_alpha_exp_beta_r") == ("transformation" in method.lower())
    assert cfg.algo.init_kl_coef == float(_value(argv, "--init_kl_coef"))
    assert rp.analytic_bad_word_calc == heading.startswith("Toy")
    assert rp.evaluate_heldout_sampling == (not heading.startswith("Toy"))


@pytest.mark.parametrize("heading,argv", REALISTIC, ids=[f"{i}" for i in range(len(REALISTIC))])
def test_realistic_commands_stop_only_at_the_model_download(heading, argv):
    """Every check before the engines passes up to the model load, which names --pretrain and says the model
    must be a local path."""
    from rlhf.cli.train_ppo import check_before_engines

    cfg = for_this_machine(parse_config(TrainPPOConfig, argv).with_demo_defaults())
    world = 1
    with pytest.raises(UsageError, match=f"--pretrain {_value(argv, '--pretrain')}: the model must be a local "
                                         "path.*huggingface-cli download"):
        check_before_engines(cfg, world)


def test_a_realistic_command_under_torchrun_prints_one_error_line(tmp_path):
    _, argv = next((h, a) for h, a in REALISTIC if h.endswith("/ RePULSe"))
    proc = run_torchrun(1, "-m rlhf.cli.train_ppo", *argv, timeout=300)
    assert proc.returncode != 0
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--pretrain HuggingFaceTB/SmolLM-135M-Instruct: the model must be a local path" \
        in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr.split(errors[0])[0]


def test_the_gcg_command_stops_only_at_the_model_download(tmp_path):
    """With the trained checkpoint and the goals file replaced by local ones, the fork's GCG command stops at
    --pretrain (a hub name)."""
    from rlhf.cli.evaluate_gcg import main

    argv = list(GCG[0])
    _set(argv, "--ckpt_path", f"{TINY_DIR}/policy")
    _set(argv, "--file_path", f"{TINY_DIR}/gcg_goals.csv")
    parse_config(EvaluateGCGConfig, argv)
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--save_path", str(tmp_path)])
    assert exit_info.value.code == 2


# --- the toy commands, trained -------------------------------------------------------------------------------

SHRINK = {"--micro_train_batch_size": "8", "--train_batch_size": "8", "--duplicate_rollout_batch_by": "8",
          "--fit_steps": "2", "--harmlessness_training_num_episodes": "2", "--prompt_max_len": "8"}
"""The toy's sizes, shrunk: 8 samples per step instead of 500, 2 fit steps of 2 episodes instead of 50 of 5-10,
prompts of at most 8 tokens (the tiny policy has 256 positions, distilgpt2 1024)."""


def toy_replay(argv: list[str], out: Path) -> list[str]:
    """`argv` with the embedded toy in place of distilgpt2, the toxicity model and the prompt dataset, the
    output paths under `out`, the sizes of SHRINK (PPO: 2 episodes per fit step) and CPU settings."""
    argv = list(argv)
    _set(argv, "--pretrain", f"{TINY_DIR}/policy")
    at = argv.index("--reward_pretrain")
    argv[at:at + 2] = ["--remote_rm_url", TOY_REWARD]  # the toy reward declares its bad words (x y z)
    _set(argv, "--prompt_data", TOY_PROMPTS)
    for flag, sub in (("--save_path", "model_out"), ("--ckpt_path", "ckpt"), ("--save_info_path", "info")):
        _set(argv, flag, str(out / sub))
    for flag, value in SHRINK.items():
        if flag in argv:
            _set(argv, flag, value)
    if "--do_harmlessness_training" not in argv:
        _set(argv, "--num_episodes", "2")
    return [*argv, *CPU, "--rollout_engine", "hf"]


def _exact_log_p_bad_of_the_tiny_policy() -> float:
    from rlhf.evaluation.bad_outputs import log_p_bad, next_token_logprobs_V, second_token_logprobs_VV
    from rlhf.models.loading import load_causal_lm, load_tokenizer
    from rlhf.trainers.repulse_eval import bad_token_ids

    tok = load_tokenizer(f"{TINY_DIR}/policy")
    model = load_causal_lm(f"{TINY_DIR}/policy", torch.float32, "sdpa").eval()
    ids = tok(json.loads(Path(TOY_PROMPTS).read_text())["prompt"], add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        first = next_token_logprobs_V(model, torch.tensor([ids]))[0]
        second = second_token_logprobs_VV(model, ids, first.shape[0])
    return float(log_p_bad(first, second, bad_token_ids(TOY_BAD_WORDS, tok), tok.eos_token_id))


def _toy_id(index: int, heading: str, argv: list[str]) -> str:
    method = heading.rsplit(" / ", 1)[1].replace("REINFORCE with reward transformation", "transformed")
    return f"{index}-kl{_value(argv, '--init_kl_coef')}-{method.replace(' ', '_')}"


@pytest.mark.slow
@pytest.mark.examples
@pytest.mark.parametrize("heading,argv", TOY, ids=[_toy_id(i, h, a) for i, (h, a) in enumerate(TOY)])
def test_toy_command_trains_on_the_embedded_toy(heading, argv, tmp_path):
    proc = run_torchrun(1, "-m rlhf.cli.train_ppo", *toy_replay(argv, tmp_path), timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    out = tmp_path / "model_out"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    evals = [r for r in rows if "log_p_bad" in r]
    steps_per_fit = 2  # one prompt per step: 2 episodes of 1 step
    assert [r["step"] for r in evals] == [0, steps_per_fit, 2 * steps_per_fit]
    # before any update every method evaluates the same tiny policy exactly
    assert evals[0]["log_p_bad"] == pytest.approx(_exact_log_p_bad_of_the_tiny_policy(), abs=1e-5)
    assert all(math.isfinite(r["log_p_bad"]) and -5 <= r["reward_mean"] <= 1 for r in evals)
    info = [json.loads(line) for line in (tmp_path / "info" / "evaluations.jsonl").open()]
    assert [r["log_p_bad"] for r in info] == [r["log_p_bad"] for r in evals]
    assert evals[-1]["samples_drawn"] == 8 * 2 * steps_per_fit * (2 if heading.endswith("/ RePULSe") else 1)
    assert evals[-1]["log_p_bad"] != evals[0]["log_p_bad"]  # the policy was trained
    assert (out / "model" / "config.json").exists()
    assert (out / "proposal").exists() == heading.endswith("/ RePULSe")
    assert "analytic evaluation after every fit step: exact log P(bad) of 2-token responses to 'copy :', " \
           "bad words 'x y z'" in proc.stdout
