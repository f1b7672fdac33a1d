"""LoRA / QLoRA (peft) on every trained model: the flags and their OpenRLHF defaults; after training (B != 0) the
merged weights give the adapter model's log-probs and values; checkpoints hold the adapters alone and resume
exactly; the rollout engine fed the merged weights agrees with the actor (the vLLM parity check); SFT learns
with only adapters trainable; `lora_combiner` output loads with plain transformers; --load_in_4bit is refused
without CUDA and trains on a GPU.

    torchrun --nproc_per_node 2 -m tests.test_lora OUT.json    (the vLLM parity worker)
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file

from rlhf.assets import EMBEDDED_MODEL_DIR
from rlhf.config.common import LoRAConfig
from tests.distributed import run_torchrun
from tests.tiny_runs import CPU, SMALL

LORA = LoRAConfig(lora_rank=4, lora_alpha=16)
FP32 = torch.float32


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


def _batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(4, 64, (3, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    return ids.masked_fill(mask == 0, 0), mask  # pad id 0, as the sequence-classification head expects


SFT = [*CPU, "--train_batch_size", "16", "--micro_train_batch_size", "8", "--max_len", "32", "--max_epochs", "1",
       "--learning_rate", "1e-2", "--lr_warmup_ratio", "0.1", "--max_steps", "16", "--zero_stage", "2",
       "--lora_rank", "8", "--lora_alpha", "16", "--eval_steps", "8"]


def _sft(out, *extra):
    proc = run_torchrun(1, "-m rlhf.cli.train_sft", *SFT, "--save_path", str(out), *extra)
    assert proc.returncode == 0, proc.stderr[-6000:]
    with open(out / "metrics.jsonl") as f:
        return [json.loads(line) for line in f], proc.stdout


def test_sft_with_lora_learns_and_saves_adapters(tmp_path):
    """Held-out NLL falls with only the adapters trained; --save_path and the checkpoints hold the adapters
    alone; the combined model is the adapter model. (Resuming from adapter-only checkpoints:
    tests/dist/test_lora_zero3.py, in one process.)"""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rlhf.cli.lora_combiner import main
    from rlhf.models.logprobs import sequence_logprobs

    ckpt = tmp_path / "ckpt"
    rows, _ = _sft(tmp_path / "straight", "--save_steps", "16", "--ckpt_path", str(ckpt))
    evals = [r["eval_gpt_loss"] for r in rows if "eval_gpt_loss" in r]
    assert evals[-1] < 0.85 * evals[0], evals
    out = tmp_path / "straight"
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 8
    adapter = load_file(out / "adapter_model.safetensors")
    assert adapter and all(".lora_A." in k or ".lora_B." in k for k in adapter)
    state = ckpt / "global_step16" / "model" / "state"
    saved = torch.load(state / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    assert saved and all("lora_" in k for k in saved)
    model_bytes = os.path.getsize(os.path.join(EMBEDDED_MODEL_DIR, "model.safetensors"))
    assert sum(os.path.getsize(state / f) for f in os.listdir(state)) < model_bytes  # adapters + their Adam states

    main(["--model_path", EMBEDDED_MODEL_DIR, "--lora_path", str(out), "--output_path", str(tmp_path / "merged"),
          "--param_dtype", "fp32"])
    ids, mask = _batch()
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL_DIR), str(out))
    with torch.no_grad():
        want = sequence_logprobs(peft_model.eval(), ids, mask)
        got = sequence_logprobs(AutoModelForCausalLM.from_pretrained(tmp_path / "merged"), ids, mask)
    assert float(((want - got).abs() * mask[:, 1:]).max()) < 1e-5


# ---------------------------------------------------------------- train_ppo and the rollout engine


@pytest.mark.vllm
def test_engine_logprobs_match_lora_actor_after_push(tmp_path):
    """The vLLM parity check (tests/workers/vllm_parity.py) with a LoRA actor on ZeRO-3: after one training step
    the merged weights go into every rank's engine, whose log-probs then equal the actor's."""
    pytest.importorskip("vllm")
    out = tmp_path / "parity.json"
    proc = run_torchrun(2, "-m tests.test_lora", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    report = json.loads(out.read_text())
    print(report)
    assert report["num_tokens"] > 20
    assert report["diff_vs_initial_weights"] > 1e-2, "the pushed adapters must have changed the engine's weights"
    assert report["max_abs_diff"] <= 1e-4


def test_ppo_with_lora_actor_and_critic(tmp_path):
    """train_ppo (GAE: actor and critic both get adapters, as in OpenRLHF; one rank, HF generation, packed
    samples, checkpointed activations) saves both as adapters; the critic's combines (--is_rm) into a sequence
    classifier."""
    from transformers import AutoModelForSequenceClassification

    from rlhf.cli.lora_combiner import main

    out = tmp_path / "run"
    flags = [a for a in SMALL if a not in ("group_norm", "--advantage_estimator")]
    proc = run_torchrun(1, "-m rlhf.cli.train_ppo", *flags, "--max_steps", "2", "--zero_stage", "2", "--lora_rank",
                        "4", "--save_path", str(out), "--critic_learning_rate", "1e-3", "--rollout_engine", "hf",
                        "--packing_samples", "--gradient_checkpointing")
    assert proc.returncode == 0, proc.stderr[-6000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and "value_loss" in rows[-1] and "policy_loss" in rows[-1]
    for role in ("model", "critic"):
        keys = load_file(out / role / "adapter_model.safetensors").keys()
        assert keys and all("lora_" in k or k == "base_model.model.score.weight" for k in keys), role
    assert "base_model.model.score.weight" in load_file(out / "critic" / "adapter_model.safetensors")
    main(["--model_path", EMBEDDED_MODEL_DIR, "--lora_path", str(out / "critic"), "--output_path",
          str(tmp_path / "critic"), "--param_dtype", "fp32", "--is_rm"])
    assert AutoModelForSequenceClassification.from_pretrained(tmp_path / "critic").num_labels == 1


def _vllm_parity_worker(out_path: str) -> None:
    """tests/workers/vllm_parity.py's check, its actor replaced by a LoRA actor (ZeRO-3, TP 1)."""
    from tests.workers import vllm_parity

    vllm_parity.build_actor = lambda zero_stage, lr, grad_accum_steps: _role("actor", zero_stage, lr)
    vllm_parity.main(out_path, 3, 1)


if __name__ == "__main__":
    _vllm_parity_worker(sys.argv[1])
