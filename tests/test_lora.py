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
import shutil
import sys
from contextlib import nullcontext

import pytest
import torch
from safetensors.torch import load_file

from rlhf.assets import EMBEDDED_MODEL_DIR
from rlhf.config.common import LoRAConfig
from tests.distributed import run_on_ranks, run_torchrun
from tests.test_e2e import CPU, SMALL

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


def _merged_log_probs_and_values(merged_actor: dict, merged_critic: dict, exp) -> tuple[torch.Tensor, torch.Tensor]:
    """What plain (unadapted) models loaded with the merged weights give on the experience's sequences."""
    from rlhf.models.loading import load_causal_lm
    from rlhf.models.logprobs import sequence_logprobs
    from rlhf.models.value import load_scalar_head_model, token_values

    lm = load_causal_lm(EMBEDDED_MODEL_DIR, FP32, "sdpa")
    lm.load_state_dict(merged_actor, strict=True)
    head = load_scalar_head_model(EMBEDDED_MODEL_DIR, "score", FP32, "sdpa", fresh_head=True)
    head.load_state_dict(merged_critic, strict=True)
    with torch.no_grad():
        return (sequence_logprobs(lm, exp.sequences_BT, exp.attention_mask_BT),
                token_values(head, exp.sequences_BT, exp.attention_mask_BT))


def engine_round_trip(out_dir: str) -> dict:
    """Two ZeRO-3 ranks: actor and critic train 2 steps with LoRA; merged weights vs the adapters; both saved
    (adapters); the actor's checkpoint after step 2, then step 3 both straight and from a fresh model resumed
    from it."""
    import torch.distributed as dist

    from rlhf.engines.weight_sync import meta_param_specs
    from rlhf.models.loading import load_tokenizer
    from tests.test_dp_equivalence import synthetic_experiences

    torch.manual_seed(0)
    rank = dist.get_rank()
    actor, critic = _role("actor", 3), _role("critic", 3)
    exp = synthetic_experiences(64)
    exp.old_logprobs_BT1 = (actor.logprobs(exp.sequences_BT, exp.attention_mask_BT) + exp.old_logprobs_BT1) \
        * exp.action_mask_BT1
    exp.values_BT1 = critic.values(exp.sequences_BT, exp.attention_mask_BT)
    exp.returns_BT1 = exp.values_BT1 + exp.advantages_BT1
    mine = [exp.slice(2 * rank, 2 * rank + 2)]
    initial_actor = actor.model.gathered_state_dict(is_writer=True)
    initial_head = critic.model.gathered_state_dict(is_writer=True)["score.weight"]
    for _ in range(2):
        actor.train_batch(mine, kl_coef=0.0)
        critic.train_batch(mine)
    merged_actor = actor.model.gathered_state_dict(is_writer=True)
    merged_critic = critic.model.gathered_state_dict(is_writer=True)
    merged_lp, merged_values = _merged_log_probs_and_values(merged_actor, merged_critic, exp)
    result = {
        "trainable": [n for n, p in actor.model.module.named_parameters() if p.requires_grad],
        "critic_trainable": [n for n, p in critic.model.module.named_parameters() if p.requires_grad],
        "specs": [(s.name, s.shape) for s in meta_param_specs(EMBEDDED_MODEL_DIR, FP32)],
        "merged": [(n, tuple(t.shape)) for n, t in merged_actor.items()],
        "moved": max(float((merged_actor[n] - initial_actor[n]).abs().max()) for n in initial_actor),
        "head_moved": float((merged_critic["score.weight"] - initial_head).abs().max()),
        "lp_diff": float((actor.logprobs(exp.sequences_BT, exp.attention_mask_BT) - merged_lp).abs().max()),
        "value_diff": float((critic.values(exp.sequences_BT, exp.attention_mask_BT) - merged_values[:, :-1])
                            .abs().max()),
        "exp": exp, "merged_lp": merged_lp, "merged_values": merged_values,
    }
    tokenizer = load_tokenizer(EMBEDDED_MODEL_DIR)
    actor.model.save_hf(os.path.join(out_dir, "actor"), tokenizer, is_writer=rank == 0)
    critic.model.save_hf(os.path.join(out_dir, "critic"), tokenizer, is_writer=rank == 0)
    ckpt_dir = os.path.join(out_dir, "ckpt")
    actor.model.save_state(ckpt_dir)
    straight = actor.train_batch(mine, kl_coef=0.0)
    resumed = _role("actor", 3)
    resumed.model.load_state(ckpt_dir)
    again = resumed.train_batch(mine, kl_coef=0.0)
    after, after_resumed = dict(actor.model.full_parameters()), dict(resumed.model.full_parameters())
    result["resume_step"] = (straight["policy_loss"], again["policy_loss"], straight["grad_norm"], again["grad_norm"])
    result["resume_weight_diff"] = max(float((after[n] - after_resumed[n]).abs().max()) for n in after)
    return result


def test_merged_weights_checkpoints_and_resume_on_zero3(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from rlhf.cli.lora_combiner import main
    from rlhf.models.logprobs import sequence_logprobs
    from rlhf.models.value import last_token_values

    results = run_on_ranks(2, engine_round_trip, str(tmp_path))
    r = results[0]
    assert r["trainable"] and all(".lora_A." in n or ".lora_B." in n for n in r["trainable"])
    assert r["critic_trainable"][-1] == "base_model.model.score.modules_to_save.default.weight"
    assert all("lora_" in n for n in r["critic_trainable"][:-1])
    # the merged stream is the unadapted model's (names, order, shapes): what the weight push expects
    assert r["merged"] == r["specs"]
    assert r["moved"] > 1e-3 and r["head_moved"] > 1e-3, "B != 0 and the head trained"
    assert r["lp_diff"] < 1e-5 and r["value_diff"] < 1e-5, r
    straight_loss, resumed_loss, straight_norm, resumed_norm = r["resume_step"]
    assert resumed_loss == pytest.approx(straight_loss, abs=1e-7)
    assert resumed_norm == pytest.approx(straight_norm, rel=1e-6)
    assert r["resume_weight_diff"] < 1e-7
    for rank in range(2):  # each rank's DeepSpeed module state holds its adapters only
        saved = torch.load(tmp_path / "ckpt" / "state" / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt",
                           weights_only=False)
        assert sorted(saved["module"]) == sorted(r["trainable"])
    # the saved adapters (gathered from ZeRO-3) reload with peft, and combine into plain models, to the same outputs
    exp = r["exp"]
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL_DIR), tmp_path / "actor")
    with torch.no_grad():
        reloaded = sequence_logprobs(adapter.eval(), exp.sequences_BT, exp.attention_mask_BT)
    assert float((reloaded - r["merged_lp"]).abs().max()) < 1e-5
    main(["--model_path", EMBEDDED_MODEL_DIR, "--lora_path", str(tmp_path / "critic"), "--output_path",
          str(tmp_path / "rm"), "--param_dtype", "fp32", "--is_rm"])
    rm = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm")
    ids = exp.sequences_BT.masked_fill(exp.attention_mask_BT == 0, 0)
    with torch.no_grad():
        scores = rm(input_ids=ids, attention_mask=exp.attention_mask_BT).logits.squeeze(-1)
    want = last_token_values(r["merged_values"], exp.attention_mask_BT)
    torch.testing.assert_close(scores, want, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- lora_combiner


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


# ---------------------------------------------------------------- train_sft end to end

SFT = [*CPU, "--train_batch_size", "16", "--micro_train_batch_size", "8", "--max_len", "32", "--max_epochs", "1",
       "--learning_rate", "1e-2", "--lr_warmup_ratio", "0.1", "--max_steps", "16", "--zero_stage", "2",
       "--lora_rank", "8", "--lora_alpha", "16", "--eval_steps", "8"]


def _sft(out, *extra):
    proc = run_torchrun(1, "-m rlhf.cli.train_sft", *SFT, "--save_path", str(out), *extra)
    assert proc.returncode == 0, proc.stderr[-6000:]
    with open(out / "metrics.jsonl") as f:
        return [json.loads(line) for line in f], proc.stdout


def test_sft_with_lora_learns_saves_adapters_and_resumes(tmp_path):
    """Held-out NLL falls with only the adapters trained; --save_path and the checkpoints hold the adapters
    alone; resuming from the middle gives the straight run's steps; the combined model is the adapter model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rlhf.cli.lora_combiner import main
    from rlhf.models.logprobs import sequence_logprobs

    ckpt = tmp_path / "ckpt"
    rows, _ = _sft(tmp_path / "straight", "--save_steps", "8", "--ckpt_path", str(ckpt))
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

    shutil.rmtree(ckpt / "global_step16")
    resumed, stdout = _sft(tmp_path / "resumed", "--load_checkpoint", "--ckpt_path", str(ckpt))
    assert f"resumed from {ckpt}/global_step8 after 8 steps" in stdout
    by_step = {r["step"]: r for r in rows}
    for row in resumed:
        assert {k: v for k, v in row.items() if not k.startswith("time/")} == \
            {k: v for k, v in by_step[row["step"]].items() if not k.startswith("time/")}
    assert load_file(tmp_path / "resumed" / "adapter_model.safetensors").keys() == adapter.keys()

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


# ---------------------------------------------------------------- QLoRA (CUDA)


@pytest.mark.gpu
def test_qlora_trains_adapters_on_a_4bit_base_and_merges():
    pytest.importorskip("bitsandbytes")
    from rlhf.models.loading import load_causal_lm
    from rlhf.models.logprobs import sequence_logprobs
    from rlhf.models.lora import apply_lora, check_lora, is_quantized, merged_parameters

    cfg = LoRAConfig(lora_rank=8, lora_alpha=16, load_in_4bit=True)
    check_lora(cfg)
    model = apply_lora(load_causal_lm(EMBEDDED_MODEL_DIR, torch.bfloat16, "sdpa", load_in_4bit=True), cfg)
    assert is_quantized(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.bfloat16 for p in trainable)
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    ids, mask = (t.cuda() for t in _batch())
    losses = []
    for _ in range(8):
        loss = -(sequence_logprobs(model, ids, mask) * mask[:, 1:]).sum() / mask[:, 1:].sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    merged = dict(merged_parameters(model, lambda _: nullcontext()))
    plain = load_causal_lm(EMBEDDED_MODEL_DIR, torch.bfloat16, "sdpa").cuda()
    plain.load_state_dict(merged, strict=True)
    with torch.no_grad():
        diff = (sequence_logprobs(model, ids, mask) - sequence_logprobs(plain, ids, mask)).abs() * mask[:, 1:]
    assert float(diff.max()) < 0.1  # bf16 activations: the adapter path and the merged weight round differently


if __name__ == "__main__":
    _vllm_parity_worker(sys.argv[1])
