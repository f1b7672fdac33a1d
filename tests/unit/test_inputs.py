"""Bad user input fails before any engine starts, with a message naming the file, row or flag."""

import json
import os
import socket

import pytest
import torch

from rlhf.assets import EMBEDDED_MODEL_DIR, EMBEDDED_PROMPTS, EMBEDDED_REWARD, EMBEDDED_REWARD_MODEL_DIR
from rlhf.config.errors import UsageError
from rlhf.config.flags import parse_config
from rlhf.config.ppo_config import DataConfig, TrainPPOConfig
from rlhf.core.run import check_outputs, default_ckpt_path
from rlhf.data.prompts import PromptSampler, load_prompts
from rlhf.models.loading import load_tokenizer
from rlhf.models.value import check_scalar_head, load_scalar_head_model
from rlhf.rewards.base import RewardInputs
from rlhf.rewards.reward_func import RewardFuncFile
from rlhf.trainers.ppo_run import check_before_engines, run


def inputs(queries, prompts, labels):
    n = len(queries)
    return RewardInputs(list(queries), list(prompts), list(labels), torch.zeros(n, 1, dtype=torch.long),
                        torch.ones(n, 1, dtype=torch.long))


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(EMBEDDED_MODEL_DIR)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_missing_dataset_file(tmp_path, tokenizer):
    with pytest.raises(ValueError, match=r"--prompt_data .*nope.jsonl: no such file or directory"):
        load_prompts(DataConfig(prompt_data=str(tmp_path / "nope.jsonl")), tokenizer)


def test_missing_input_key_names_file_row_and_columns(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "p.jsonl", [{"input": "copy 1 :"}, {"question": "copy 2 :", "label": "2"}])
    with pytest.raises(ValueError, match=r"p.jsonl, row 2: no column 'input' \(columns: label, question\); "
                                         r"pass the right one with --input_key"):
        load_prompts(DataConfig(prompt_data=path), tokenizer)


def test_missing_label_key(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "p.jsonl", [{"input": "copy 1 :"}])
    with pytest.raises(ValueError, match="row 1: no column 'answer' for --label_key"):
        load_prompts(DataConfig(prompt_data=path, label_key="answer"), tokenizer)


def test_invalid_json_line_is_located(tmp_path, tokenizer):
    path = tmp_path / "p.jsonl"
    path.write_text('{"input": "copy 1 :"}\n{"input": \n')
    with pytest.raises(ValueError, match=r"p.jsonl, line 2: not valid JSON"):
        load_prompts(DataConfig(prompt_data=str(path)), tokenizer)


def test_long_prompts_are_dropped_and_counted(tmp_path, tokenizer):
    rows = [{"input": "copy 1 :"}, {"input": "a b c d e f copy 2 :"}, {"input": "a b c d e copy 3 :"}]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    with pytest.warns(UserWarning, match="dropped 2 of 3 prompts longer than --prompt_max_len 5 tokens"):
        prompts = load_prompts(DataConfig(prompt_data=path, prompt_max_len=5), tokenizer)
    assert [p.text for p in prompts] == ["copy 1 :"]
    with pytest.raises(ValueError, match="no usable prompts"), pytest.warns(UserWarning):
        load_prompts(DataConfig(prompt_data=path, prompt_max_len=2), tokenizer)


def test_empty_prompts_are_named_by_file_and_row(tmp_path, tokenizer):
    rows = [{"input": "copy 1 :"}, {"input": ""}, {"input": "copy 2 :"}, {"input": "   "}, {"input": "</s>"}]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    with pytest.raises(ValueError) as err:
        load_prompts(DataConfig(prompt_data=path), tokenizer)
    message = str(err.value)
    assert "3 prompt(s) would generate from nothing" in message
    assert f"{path}, row 2: the prompt is empty after formatting" in message
    assert f"{path}, row 4: the prompt is empty after formatting" in message
    assert f"{path}, row 5: the prompt '</s>' is only special tokens" in message
    assert "row 1" not in message and "row 3" not in message
    # a template around an empty question is not empty: left to the user
    assert len(load_prompts(DataConfig(prompt_data=write_jsonl(tmp_path / "q.jsonl", [{"input": ""}]),
                                       input_template="copy {} :"), tokenizer)) == 1


def test_templates_and_labels(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "p.jsonl", [{"q": "copy 4 :", "a": 4}])
    plain = load_prompts(DataConfig(prompt_data=path, input_key="q", label_key="a",
                                    input_template="user : {} assistant :"), tokenizer)
    assert plain[0].text == "user : copy 4 : assistant :" and plain[0].label == 4
    chat = load_prompts(DataConfig(prompt_data=path, input_key="q", apply_chat_template=True), tokenizer)
    assert chat[0].text == "user : copy 4 : assistant :"
    assert list(chat[0].token_ids) == tokenizer("user : copy 4 : assistant :", add_special_tokens=False)["input_ids"]


def test_directory_and_json_at_syntax(tmp_path, tokenizer):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "train.json").write_text(json.dumps([{"input": "copy 5 :"}]))
    (tmp_path / "d" / "test.json").write_text(json.dumps([{"input": "copy 6 :"}]))
    assert [p.text for p in load_prompts(DataConfig(prompt_data=f"json@{tmp_path / 'd'}"), tokenizer)] == ["copy 5 :"]


def test_sampler_is_deterministic_and_covers_an_episode(tokenizer):
    prompts = load_prompts(DataConfig(prompt_data=EMBEDDED_PROMPTS, max_samples=40), tokenizer)
    a, b = PromptSampler(prompts, 8, seed=1), PromptSampler(prompts, 8, seed=1)
    assert a.steps_per_episode == 5
    first_episode = [p for s in range(5) for p in a.batch(s)]
    assert sorted(p.text for p in first_episode) == sorted(p.text for p in prompts)
    assert [p.text for p in a.batch(7)] == [p.text for p in b.batch(7)]
    assert [p.text for p in a.batch(0)] != [p.text for p in a.batch(5)]  # reshuffled next episode


def test_reward_file_without_reward_func(tmp_path):
    path = tmp_path / "r.py"
    path.write_text("def score(x):\n    return 1\n")
    with pytest.raises(ValueError, match=r"r.py defines no function reward_func\(queries, prompts, labels\)"):
        RewardFuncFile(str(path))
    with pytest.raises(ValueError, match="file not found"):
        RewardFuncFile(str(tmp_path / "missing.py"))


def test_reward_func_wrong_length(tmp_path):
    path = tmp_path / "r.py"
    path.write_text("def reward_func(queries, prompts, labels):\n    return [1.0]\n")
    with pytest.raises(ValueError, match=r"returned 1 rewards for 3 queries; it must return exactly one per query"):
        RewardFuncFile(str(path)).score(inputs(["a", "b", "c"], ["a", "b", "c"], [None] * 3))


def test_reward_func_dict_output_and_nonfinite(tmp_path):
    path = tmp_path / "r.py"
    path.write_text("def reward_func(queries, prompts, labels):\n"
                    "    return {'rewards': [1, 2], 'scores': [0, 1], 'extra_logs': {'len': [3, 4]}}\n")
    out = RewardFuncFile(str(path)).score(inputs(["a", "b"], ["", ""], [None, None]))
    torch.testing.assert_close(out.rewards_B, torch.tensor([1.0, 2.0]))
    torch.testing.assert_close(out.scores_B, torch.tensor([0.0, 1.0]))
    torch.testing.assert_close(out.extra_logs["len"], torch.tensor([3.0, 4.0]))
    path.write_text("def reward_func(queries, prompts, labels):\n    return [float('nan')]\n")
    with pytest.raises(ValueError, match="non-finite rewards"):
        RewardFuncFile(str(path)).score(inputs(["a"], [""], [None]))


def test_embedded_reward_scores_the_copy_task():
    reward = RewardFuncFile(EMBEDDED_REWARD)
    out = reward.score(inputs(["copy 3 : 3 3 1 3 3", "copy 3 : 1 2"], ["copy 3 :", "copy 3 :"], ["3", "3"]))
    torch.testing.assert_close(out.rewards_B, torch.tensor([0.75, 0.0]))


def test_run_fails_before_engines_start(tmp_path, monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(key, raising=False)
    cfg = parse_config(TrainPPOConfig, ["--prompt_data", str(tmp_path / "missing.jsonl"), "--train_batch_size", "8",
                                        "--prompt_max_len", "16", "--generate_max_len", "8",
                                        "--verbose"])  # --verbose: leave this process's library loggers alone
    with pytest.raises(ValueError, match="no such file or directory"):
        run(cfg)


def _demo_cfg(*argv):
    return parse_config(TrainPPOConfig, ["--train_batch_size", "8", "--prompt_max_len", "16",
                                         "--generate_max_len", "8", *argv]).with_demo_defaults()


def _check_outputs(cfg):
    """What every training job checks of its outputs before any engine (`rlhf.core.run.start`)."""
    check_outputs(cfg.logging, cfg.checkpoint, default_ckpt_path(cfg))


def test_unwritable_output_directories_fail_before_engines(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(UsageError, match=rf"--save_path {blocker}/out is not writable \(.*not a directory\)"):
        _check_outputs(_demo_cfg("--save_path", str(blocker / "out")))
    with pytest.raises(UsageError, match=rf"--ckpt_path {blocker}/ck is not writable"):
        _check_outputs(_demo_cfg("--save_path", str(tmp_path / "out"), "--save_steps", "1",
                                       "--ckpt_path", str(blocker / "ck")))
    _check_outputs(_demo_cfg("--save_path", str(tmp_path / "a" / "b"), "--save_steps", "1",
                                   "--ckpt_path", str(tmp_path)))
    assert sorted(os.listdir(tmp_path)) == ["file"]  # the check leaves nothing behind


def test_an_earlier_runs_output_is_refused_before_engines(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    with pytest.raises(UsageError, match=r"metrics.jsonl already holds 2 rows of metrics from an earlier run: pass "
                                         r"--load_checkpoint to continue that run, or choose another --save_path"):
        _check_outputs(_demo_cfg("--save_path", str(tmp_path)))
    _check_outputs(_demo_cfg("--save_path", str(tmp_path), "--load_checkpoint"))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a torchrun restart resumes by itself
    _check_outputs(_demo_cfg("--save_path", str(tmp_path)))
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    with pytest.raises(UsageError, match=r"--load_checkpoint: --ckpt_path .*/nothing does not exist"):
        _check_outputs(_demo_cfg("--save_path", str(tmp_path), "--load_checkpoint", "--ckpt_path",
                                       str(tmp_path / "nothing")))


def test_unreachable_reward_server_fails_before_engines(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/get_reward"
    with pytest.raises(UsageError, match=rf"--remote_rm_url {url}: cannot connect to 127.0.0.1:{port} within 5s "
                                         r"\(.*\); start the reward server first"):
        check_before_engines(_demo_cfg("--save_path", str(tmp_path), "--remote_rm_url", url), 1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        url = f"http://127.0.0.1:{s.getsockname()[1]}/get_reward"
        check_before_engines(_demo_cfg("--save_path", str(tmp_path), "--remote_rm_url", url), 1)


def test_reward_model_without_its_head_is_refused():
    with pytest.raises(ValueError, match=rf"--reward_pretrain {EMBEDDED_MODEL_DIR} has no value head 'score.weight' "
                                         r"\(--value_head_prefix score\); keys outside the base model: lm_head.weight"):
        check_scalar_head(EMBEDDED_MODEL_DIR, "score")
    with pytest.raises(ValueError, match=r"no value head 'scroe.weight' .*keys outside the base model: score.weight"):
        load_scalar_head_model(EMBEDDED_REWARD_MODEL_DIR, "scroe", torch.float32, "sdpa")
    check_scalar_head(EMBEDDED_REWARD_MODEL_DIR, "score")
    critic = load_scalar_head_model(EMBEDDED_MODEL_DIR, "score", torch.float32, "sdpa", fresh_head=True)
    assert torch.isfinite(critic.head.weight).all()  # a critic may start from the policy with a fresh head


def test_reward_model_without_head_fails_before_engines(tmp_path):
    with pytest.raises(ValueError, match=rf"--reward_pretrain {EMBEDDED_MODEL_DIR} has no value head"):
        check_before_engines(parse_config(TrainPPOConfig, [
            "--pretrain", EMBEDDED_MODEL_DIR, "--reward_pretrain", EMBEDDED_MODEL_DIR, "--prompt_data",
            EMBEDDED_PROMPTS, "--train_batch_size", "8", "--prompt_max_len", "16", "--generate_max_len", "8",
            "--save_path", str(tmp_path / "out")]), 1)
    assert not (tmp_path / "out").exists()


def test_cli_exits_2_for_a_reward_model_without_head(tmp_path, monkeypatch, capsys):
    from rlhf.cli.train_ppo import main

    for key in ("RANK", "WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(SystemExit) as exc:
        main(["--pretrain", EMBEDDED_MODEL_DIR, "--reward_pretrain", EMBEDDED_REWARD_MODEL_DIR, "--value_head_prefix",
              "value_head", "--prompt_data", EMBEDDED_PROMPTS, "--train_batch_size", "8", "--prompt_max_len", "16",
              "--generate_max_len", "8", "--attn_implementation", "sdpa", "--save_path", str(tmp_path / "out"),
              "--verbose"])  # --verbose: leave this process's library loggers alone
    assert exc.value.code == 2
    assert (f"error: --reward_pretrain {EMBEDDED_REWARD_MODEL_DIR} has no value head 'value_head.weight'"
            in capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


def test_serve_rm_refuses_a_reward_model_without_head(capsys):
    from rlhf.cli import serve_rm

    with pytest.raises(SystemExit) as exc:
        serve_rm.main(["--reward_pretrain", EMBEDDED_REWARD_MODEL_DIR, "--value_head_prefix", "value_head"])
    assert exc.value.code == 2
    assert "has no value head 'value_head.weight' (--value_head_prefix value_head); keys outside the base " \
           "model: score.weight" in capsys.readouterr().err


def test_use_wandb_without_its_package_fails_before_any_engine(tmp_path, monkeypatch):
    import importlib.util

    from rlhf.config.shared_config import CheckpointConfig, LoggingConfig
    from rlhf.core import run as core_run

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(core_run.importlib.util, "find_spec", lambda name: None if name == "wandb" else
                        find_spec(name))
    logging = LoggingConfig(save_path=str(tmp_path / "out"), use_wandb="True")
    with pytest.raises(UsageError, match=r"^--use_wandb needs the wandb package: pip install wandb"):
        core_run.check_outputs(logging, CheckpointConfig(), CheckpointConfig().ckpt_path, 1)
    core_run.check_outputs(LoggingConfig(save_path=str(tmp_path / "out")), CheckpointConfig(),
                              CheckpointConfig().ckpt_path, 1)
