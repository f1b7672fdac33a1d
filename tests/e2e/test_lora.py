"""LoRA end to end: SFT learns with only the adapters trainable, --save_path and the checkpoints hold the adapters
alone, and `lora_combiner` output equals the adapter model; the vLLM parity check with a LoRA actor on ZeRO-3; PPO
with LoRA actor and critic."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from rlhf.assets import EMBEDDED_MODEL_DIR
from tests.distributed import run_job_variants, run_on_ranks
from tests.tiny_lora import lora_batch, vllm_parity_worker
from tests.tiny_runs import SMALL, TRAIN

SFT = [*TRAIN, "--train_batch_size", "16", "--micro_train_batch_size", "8", "--max_len", "32", "--max_epochs", "1",
       "--learning_rate", "1e-2", "--lr_warmup_ratio", "0.1", "--max_steps", "16", "--zero_stage", "2",
       "--lora_rank", "8", "--lora_alpha", "16", "--eval_steps", "8"]


@pytest.fixture(scope="module")
def one_rank_runs(tmp_path_factory):
    """The 1-rank LoRA runs of this file in one launch (`run_job_variants`): SFT with adapters
    (checkpointed at its last step) and PPO with adapters on the actor and the critic (GAE; HF generation, packed
    samples, checkpointed activations)."""
    tmp = tmp_path_factory.mktemp("lora")
    ppo = [a for a in SMALL if a not in ("group_norm", "--advantage_estimator")]
    run_job_variants(1, [
        ("train_sft", [*SFT, "--save_path", str(tmp / "straight"), "--save_steps", "16", "--ckpt_path",
                       str(tmp / "ckpt")]),
        ("train_ppo", [*ppo, "--max_steps", "2", "--zero_stage", "2", "--lora_rank", "4", "--save_path",
                       str(tmp / "run"), "--critic_learning_rate", "1e-3", "--rollout_engine", "hf",
                       "--packing_samples", "--gradient_checkpointing"]),
    ], tmp / "consoles", tmp / "straight", tmp / "run")
    return tmp


def test_sft_with_lora_learns_and_saves_adapters(one_rank_runs, tmp_path):
    """Held-out NLL falls with only the adapters trained; --save_path and the checkpoints hold the adapters
    alone; the combined model is the adapter model. (Resuming from adapter-only checkpoints:
    tests/dist/test_lora_zero3.py, in one process.)"""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rlhf.cli.lora_combiner import main
    from tests.references import sequence_logprobs

    ckpt, out = one_rank_runs / "ckpt", one_rank_runs / "straight"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval_gpt_loss"] for r in rows if "eval_gpt_loss" in r]
    assert evals[-1] < 0.85 * evals[0], evals
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
    ids, mask = lora_batch()
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
    run_on_ranks(2, vllm_parity_worker, str(out), init_group=False)
    report = json.loads(out.read_text())
    print(report)
    assert report["num_tokens"] > 20
    assert report["diff_vs_initial_weights"] > 1e-2, "the pushed adapters must have changed the engine's weights"
    assert report["max_abs_diff"] <= 1e-4


def test_ppo_with_lora_actor_and_critic(one_rank_runs, tmp_path):
    """train_ppo (GAE: actor and critic both get adapters, as in OpenRLHF; one rank, HF generation, packed
    samples, checkpointed activations) saves both as adapters; the critic's combines (--is_rm) into a sequence
    classifier."""
    from transformers import AutoModelForSequenceClassification

    from rlhf.cli.lora_combiner import main

    out = one_rank_runs / "run"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and "value_loss" in rows[-1] and "policy_loss" in rows[-1]
    for role in ("model", "critic"):
        keys = load_file(out / role / "adapter_model.safetensors").keys()
        assert keys and all("lora_" in k or k == "base_model.model.score.weight" for k in keys), role
    assert "base_model.model.score.weight" in load_file(out / "critic" / "adapter_model.safetensors")
    main(["--model_path", EMBEDDED_MODEL_DIR, "--lora_path", str(out / "critic"), "--output_path",
          str(tmp_path / "critic"), "--param_dtype", "fp32", "--is_rm"])
    assert AutoModelForSequenceClassification.from_pretrained(tmp_path / "critic").num_labels == 1


