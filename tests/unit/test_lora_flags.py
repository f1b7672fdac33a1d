"""LoRA / QLoRA (peft) on every trained model: the flags and their OpenRLHF defaults; after training (B != 0) the
merged weights give the adapter model's log-probs and values; checkpoints hold the adapters alone and resume
exactly; the rollout engine fed the merged weights agrees with the actor (the vLLM parity check); SFT learns
with only adapters trainable; `lora_combiner` output loads with plain transformers; --load_in_4bit is refused
without CUDA and trains on a GPU.

    torchrun --nproc_per_node 2 -m tests.test_lora OUT.json    (the vLLM parity worker)
"""

from __future__ import annotations

import os
import sys
from contextlib import nullcontext

import pytest
import torch
from safetensors.torch import load_file

from rlhf.assets import EMBEDDED_MODEL_DIR
from rlhf.config.common import LoRAConfig

LORA = LoRAConfig(lora_rank=4, lora_alpha=16)
FP32 = torch.float32


# ---------------------------------------------------------------- flags


def test_flags_have_openrlhf_defaults_and_reach_every_job():
    from rlhf.config.flags import parse_config
    from rlhf.config.ppo import TrainPPOConfig
    from rlhf.config.supervised import TrainKDConfig, TrainPRMConfig, TrainRMConfig, TrainSFTConfig

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
    from rlhf.config.supervised import TrainSFTConfig

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


def _lora_model(kind: str, zero_stage: int, lr: float = 2e-2):
    import torch.distributed as dist

    from rlhf.config.common import EngineConfig, OptimConfig
    from rlhf.engines.deepspeed_engine import DeepSpeedModel
    from rlhf.models.loading import load_causal_lm
    from rlhf.models.lora import apply_lora
    from rlhf.models.value import load_scalar_head_model

    def build():
        if kind == "actor":
            return load_causal_lm(EMBEDDED_MODEL_DIR, FP32, "sdpa")
        return load_scalar_head_model(EMBEDDED_MODEL_DIR, "score", FP32, "sdpa", fresh_head=True)

    return DeepSpeedModel(build, EngineConfig(zero_stage=zero_stage),
                          OptimConfig(lr_warmup_ratio=0.0, lr_scheduler="constant"), learning_rate=lr, bf16=False,
                          micro_batch_size=2, grad_accum_steps=1, num_optimizer_steps=10, device=torch.device("cpu"),
                          dp_group=dist.group.WORLD, adapt=lambda module: apply_lora(module, LORA), name=kind)


def _role(kind: str, zero_stage: int, lr: float = 2e-2):
    """An Actor or Critic on a LoRA DeepSpeedModel over the world (2 samples per micro-batch)."""
    import torch.distributed as dist

    from rlhf.config.ppo import AlgoConfig
    from rlhf.models.layout import PADDED
    from rlhf.models.micro_batches import MicroBatcher
    from rlhf.trainers.actor import Actor
    from rlhf.trainers.critic import Critic

    model, world, cpu = _lora_model(kind, zero_stage, lr), dist.group.WORLD, torch.device("cpu")
    infer, train = MicroBatcher(16, None, world, PADDED), MicroBatcher(2, None, world, PADDED)
    if kind == "actor":
        return Actor(model, world, cpu, temperature=1.0, algo=AlgoConfig(), infer_batcher=infer, train_batcher=train)
    return Critic(model, world, cpu, None, infer_batcher=infer, train_batcher=train)


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


def _batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(4, 64, (3, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    return ids.masked_fill(mask == 0, 0), mask  # pad id 0, as the sequence-classification head expects


def test_combiner_writes_a_plain_causal_lm(tmp_path):
    from transformers import AutoModelForCausalLM

    from rlhf.cli.lora_combiner import main
    from rlhf.models.logprobs import sequence_logprobs

    adapted = _adapter("actor", tmp_path / "adapter")
    main(["--model_path", EMBEDDED_MODEL_DIR, "--lora_path", str(tmp_path / "adapter"), "--output_path",
          str(tmp_path / "merged"), "--param_dtype", "fp32"])
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    ids, mask = _batch()
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
    ids, mask = _batch()
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


def _vllm_parity_worker(out_path: str) -> None:
    """tests/workers/vllm_parity.py's check, its actor replaced by a LoRA actor (ZeRO-3, TP 1)."""
    from tests.workers import vllm_parity

    vllm_parity.build_actor = lambda zero_stage, lr, grad_accum_steps: _role("actor", zero_stage, lr)
    vllm_parity.main(out_path, 3, 1)


if __name__ == "__main__":
    _vllm_parity_worker(sys.argv[1])
