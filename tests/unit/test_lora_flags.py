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


