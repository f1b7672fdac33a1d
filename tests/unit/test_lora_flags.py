"""LoRA / QLoRA flags and their OpenRLHF defaults on every job, bad values, --load_in_4bit refused without CUDA, and
`lora_combiner` (plain causal LM, sequence classifier, errors naming the flag)."""

from __future__ import annotations

import os
from contextlib import nullcontext

import pytest
import torch
from safetensors.torch import load_file

from rlhf.assets import EMBEDDED_MODEL_DIR
from tests.tiny_lora import FP32, LORA, lora_batch

# ---------------------------------------------------------------- flags


def test_flags_have_openrlhf_defaults_and_reach_every_job():
    from rlhf.config.flags import parse_config
    from rlhf.config.ppo_config import TrainPPOConfig
    from rlhf.config.supervised_config import TrainKDConfig, TrainPRMConfig, TrainRMConfig, TrainSFTConfig

    for root in (TrainPPOConfig, TrainSFTConfig, TrainRMConfig, TrainPRMConfig, TrainKDConfig):
        lora = parse_config(root, []).model.lora
        assert (lora.lora_rank, lora.lora_alpha, lora.target_modules, lora.lora_dropout, lora.load_in_4bit) == \
            (0, 16, ("all-linear",), 0.0, False), root
        assert not lora.enabled
        lora = parse_config(root, ["--lora_rank", "8", "--lora_alpha", "32", "--target_modules", "q_proj", "v_proj",
                                   "--lora_dropout", "0.05"]).model.lora
        assert (lora.lora_rank, lora.lora_alpha, lora.target_modules, lora.lora_dropout) == \
            (8, 32, ("q_proj", "v_proj"), 0.05)
        assert not {"lora_rank", "load_in_4bit", "target_modules"} & set(root.PENDING_FLAGS)


@pytest.mark.parametrize("argv,message", [
    (["--lora_rank", "-1"], "--lora_rank must be >= 0"),
    (["--lora_rank", "4", "--lora_dropout", "1"], "--lora_dropout must lie in [0, 1)"),
    (["--lora_rank", "4", "--target_modules"], "--target_modules needs at least one module name"),
    (["--load_in_4bit"], "--load_in_4bit freezes the base weights in 4 bits: add --lora_rank"),
    (["--lora_rank", "4", "--load_in_4bit", "--param_dtype", "fp32"], "--load_in_4bit computes in bf16"),
])
def test_bad_lora_values_name_the_flag(argv, message):
    from rlhf.config.errors import UsageError
    from rlhf.config.flags import parse_config
    from rlhf.config.supervised_config import TrainSFTConfig

    with pytest.raises(UsageError, match=message.replace("[", r"\[").replace(")", r"\)")):
        parse_config(TrainSFTConfig, argv)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
@pytest.mark.parametrize("job", ["train_sft", "train_ppo"])
def test_load_in_4bit_is_refused_without_cuda(job, tmp_path, capsys):
    import importlib

    main = importlib.import_module(f"rlhf.cli.{job}").main
    with pytest.raises(SystemExit) as exit_info:
        main(["--attn_implementation", "sdpa", "--lora_rank", "4", "--load_in_4bit", "--save_path",
              str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert "error: --load_in_4bit needs a CUDA GPU" in capsys.readouterr().err


# ---------------------------------------------------------------- engines (2 gloo ranks, ZeRO-3)




def _adapter(kind: str, path, extra: dict | None = None):
    """A LoRA model on the tiny policy with random adapters (and head), saved as a run saves it."""
    from rlhf.models.loading import load_causal_lm, load_tokenizer
    from rlhf.models.lora import adapter_state_dict, apply_lora, save_adapter
    from rlhf.models.value import load_scalar_head_model

    torch.manual_seed(0)
    base = (load_causal_lm(EMBEDDED_MODEL_DIR, FP32, "sdpa") if kind == "actor" else
            load_scalar_head_model(EMBEDDED_MODEL_DIR, "score", FP32, "sdpa", fresh_head=True))
    model = apply_lora(base, LORA)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad and "lora_A" not in name:
                p.normal_(0, 0.1)
    save_adapter(model, adapter_state_dict(model, lambda _: nullcontext()), str(path),
                 load_tokenizer(EMBEDDED_MODEL_DIR), extra)
    return model.eval()



def test_combiner_writes_a_plain_causal_lm(tmp_path):
    from transformers import AutoModelForCausalLM

    from rlhf.cli.lora_combiner import main
    from tests.references import sequence_logprobs

    adapted = _adapter("actor", tmp_path / "adapter")
    main(["--model_path", EMBEDDED_MODEL_DIR, "--lora_path", str(tmp_path / "adapter"), "--output_path",
          str(tmp_path / "merged"), "--param_dtype", "fp32"])
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    ids, mask = lora_batch()
    with torch.no_grad():
        want, got = sequence_logprobs(adapted, ids, mask), sequence_logprobs(merged, ids, mask)
        before = sequence_logprobs(AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL_DIR), ids, mask)
    assert float(((want - got).abs() * mask[:, 1:]).max()) < 1e-5
    assert float(((want - before).abs() * mask[:, 1:]).max()) > 1e-2, "the adapters must matter"
    assert load_file(tmp_path / "merged" / "model.safetensors").keys() == \
        load_file(os.path.join(EMBEDDED_MODEL_DIR, "model.safetensors")).keys()


def test_combiner_is_rm_writes_a_sequence_classifier(tmp_path):
    from transformers import AutoModelForSequenceClassification

    from rlhf.cli.lora_combiner import main
    from rlhf.models.value import last_token_values, stored_reward_norm, token_values

    adapted = _adapter("critic", tmp_path / "adapter", {"mean": 0.5, "std": 2.0})
    main(["--model_path", EMBEDDED_MODEL_DIR, "--lora_path", str(tmp_path / "adapter"), "--output_path",
          str(tmp_path / "rm"), "--param_dtype", "fp32", "--is_rm"])
    rm = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm")
    ids, mask = lora_batch()
    with torch.no_grad():
        want = last_token_values(token_values(adapted, ids, mask), mask)
        got = rm(input_ids=ids, attention_mask=mask).logits.squeeze(-1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert stored_reward_norm(str(tmp_path / "rm")) == (0.5, 2.0)


def test_combiner_errors_name_the_flag(tmp_path, capsys):
    from rlhf.cli.lora_combiner import main

    with pytest.raises(SystemExit):
        main(["--model_path", EMBEDDED_MODEL_DIR, "--lora_path", str(tmp_path), "--output_path", str(tmp_path / "o")])
    assert f"--lora_path {tmp_path}: no adapter_config.json" in capsys.readouterr().err
    _adapter("actor", tmp_path / "adapter")
    with pytest.raises(SystemExit):
        main(["--model_path", str(tmp_path / "nowhere"), "--lora_path", str(tmp_path / "adapter"), "--output_path",
              str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert f"--model_path {tmp_path / 'nowhere'}: the model must be a local HF model directory" in err




# ---------------------------------------------------------------- lora_combiner: the adapter's base and kind


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Saved adapters on the tiny policy: 'actor' (a causal LM's) and 'critic' (with its value head)."""
    root = tmp_path_factory.mktemp("adapters")
    for kind in ("actor", "critic"):
        _adapter(kind, root / kind)
    return root


def _combine(capsys, *argv: str) -> tuple[int, list[str]]:
    """lora_combiner's exit status and its stderr lines other than transformers' load report."""
    from rlhf.cli.lora_combiner import main

    try:
        main([*argv, "--param_dtype", "fp32"])
        code = 0
    except SystemExit as exit_info:
        code = exit_info.code
    lines = capsys.readouterr().err.splitlines()
    return code, [line for line in lines if line.startswith(("error:", "warning:"))]


def _other_base(path, scale: float) -> str:
    """The tiny policy's config, tokenizer and architecture with every weight times `scale`."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(EMBEDDED_MODEL_DIR, path)
    weights = load_file(path / "model.safetensors")
    save_file({k: v * scale for k, v in weights.items()}, path / "model.safetensors", metadata={"format": "pt"})
    return str(path)


def test_combiner_refuses_a_policy_adapter_on_the_reward_model(adapters, tmp_path, capsys):
    """The reward model has the policy's shapes but no lm_head: merged as a causal LM it got a random one, exit 0."""
    from rlhf.assets import EMBEDDED_REWARD_MODEL_DIR

    code, lines = _combine(capsys, "--model_path", EMBEDDED_REWARD_MODEL_DIR, "--lora_path", str(adapters / "actor"),
                           "--output_path", str(tmp_path / "merged"))
    assert code == 2 and not (tmp_path / "merged").exists()
    assert lines == [f"error: --lora_path {adapters / 'actor'} was trained on a LlamaForCausalLM "
                     f"({EMBEDDED_MODEL_DIR}), but --model_path {EMBEDDED_REWARD_MODEL_DIR} is a "
                     f"LlamaForSequenceClassification: pass --model_path {EMBEDDED_MODEL_DIR}, the base the adapter "
                     "was trained on, or --force to merge anyway"]


def test_combiner_refuses_other_weights_of_the_same_shapes_and_takes_a_copy(adapters, tmp_path, capsys):
    from rlhf.models.lora import weights_fingerprint

    other = _other_base(tmp_path / "other", 1.01)
    policy_print, other_print = weights_fingerprint(EMBEDDED_MODEL_DIR), weights_fingerprint(other)
    assert policy_print != other_print
    actor = str(adapters / "actor")
    code, lines = _combine(capsys, "--model_path", other, "--lora_path", actor, "--output_path", str(tmp_path / "o"))
    assert code == 2 and not (tmp_path / "o").exists()
    assert lines == [f"error: --lora_path {actor} was trained on {EMBEDDED_MODEL_DIR} (weights fingerprint "
                     f"{policy_print[:12]}), but --model_path {other} holds other weights ({other_print[:12]}): pass "
                     f"--model_path {EMBEDDED_MODEL_DIR}, the base the adapter was trained on, or --force to merge "
                     "anyway"]
    # --force merges, with the same line as a warning
    code, lines = _combine(capsys, "--model_path", other, "--lora_path", actor, "--output_path", str(tmp_path / "o"),
                           "--force")
    assert code == 0 and (tmp_path / "o" / "model.safetensors").exists()
    assert lines == [lines[0]] and lines[0].startswith(f"warning: --lora_path {actor} was trained on ")
    assert lines[0].endswith("the base the adapter was trained on (--force: merging anyway)")
    # a copy of the base elsewhere (moved, or stored in bf16) is the same base
    copy = _other_base(tmp_path / "copy", 1.0)
    code, lines = _combine(capsys, "--model_path", copy, "--lora_path", actor, "--output_path", str(tmp_path / "c"))
    assert (code, lines) == (0, [])
    torch.testing.assert_close(load_file(tmp_path / "c" / "model.safetensors"),
                               load_file(tmp_path / "o" / "model.safetensors"), rtol=0.0, atol=0.02)


def test_combiner_is_rm_must_fit_the_adapter(adapters, tmp_path, capsys):
    actor, critic = str(adapters / "actor"), str(adapters / "critic")
    code, lines = _combine(capsys, "--model_path", EMBEDDED_MODEL_DIR, "--lora_path", actor, "--output_path",
                           str(tmp_path / "o"), "--is_rm")
    assert code == 2 and lines == [
        f"error: --is_rm, but --lora_path {actor} is a causal LM's adapter (task_type CAUSAL_LM, no value head saved): "
        "drop --is_rm to merge it into its causal LM, or pass the reward model's or critic's adapter, or --force to "
        "merge anyway"]
    code, lines = _combine(capsys, "--model_path", EMBEDDED_MODEL_DIR, "--lora_path", critic, "--output_path",
                           str(tmp_path / "o"))
    assert code == 2 and lines == [
        f"error: --lora_path {critic} is a reward model's or critic's adapter (it saves the value head score), but "
        "--is_rm is not given: add --is_rm to write a sequence classifier (a causal LM would lose the head), or "
        "--force to merge anyway"]
    assert not (tmp_path / "o").exists()


def test_combiner_checks_an_adapter_saved_elsewhere(adapters, tmp_path, capsys):
    """Without adapter_base.json and config.json (OpenRLHF's or peft's own adapters): the fingerprint of the base
    adapter_config.json names, when it is here; a causal LM missing weights is refused in any case."""
    import json
    import shutil

    from rlhf.assets import EMBEDDED_REWARD_MODEL_DIR

    foreign = tmp_path / "foreign"
    shutil.copytree(adapters / "actor", foreign)
    (foreign / "adapter_base.json").unlink()
    (foreign / "config.json").unlink()
    other = _other_base(tmp_path / "other", 1.01)
    code, lines = _combine(capsys, "--model_path", other, "--lora_path", str(foreign), "--output_path",
                           str(tmp_path / "o"))
    assert code == 2 and len(lines) == 1
    assert lines[0].startswith(f"error: --lora_path {foreign} was trained on {EMBEDDED_MODEL_DIR} (weights "), lines
    config = json.loads((foreign / "adapter_config.json").read_text())
    (foreign / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "org/elsewhere"}))
    code, lines = _combine(capsys, "--model_path", EMBEDDED_REWARD_MODEL_DIR, "--lora_path", str(foreign),
                           "--output_path", str(tmp_path / "o"))
    assert code == 2 and not (tmp_path / "o").exists()
    assert lines == [
        f"warning: cannot check that --model_path {EMBEDDED_REWARD_MODEL_DIR} holds the weights --lora_path {foreign} "
        "was trained on (the adapter records the base org/elsewhere without a fingerprint, or one of them has no "
        "safetensors files)",
        f"error: --model_path {EMBEDDED_REWARD_MODEL_DIR} has no lm_head.weight for a causal LM, so the merged model "
        "would hold random weights there: pass the causal LM the adapter was trained on, or --is_rm for a reward "
        "model's or critic's adapter, or --force to merge anyway"]


@pytest.mark.parametrize("launcher", [{"RANK": "1", "WORLD_SIZE": "2"}, {"SLURM_PROCID": "1", "SLURM_NTASKS": "2"}])
def test_combiner_writes_once_under_a_launcher(launcher, adapters, tmp_path, monkeypatch, capsys):
    """Every rank of `torchrun --nproc_per_node 2 -m rlhf.cli.lora_combiner` runs main: rank 1 returns at once,
    rank 0 merges and writes."""
    argv = ["--model_path", EMBEDDED_MODEL_DIR, "--lora_path", str(adapters / "actor"), "--output_path",
            str(tmp_path / "merged")]
    for name, value in launcher.items():
        monkeypatch.setenv(name, value)
    assert _combine(capsys, *argv) == (0, [])
    assert not (tmp_path / "merged").exists()
    for name in launcher:
        monkeypatch.setenv(name, "0" if name in ("RANK", "SLURM_PROCID") else "2")
    assert _combine(capsys, *argv) == (0, [])
    assert (tmp_path / "merged" / "model.safetensors").exists()
