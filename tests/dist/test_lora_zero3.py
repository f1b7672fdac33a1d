"""LoRA on ZeRO-3 (2 gloo ranks, one process each): after training (B != 0) the merged weights give the adapter
model's log-probs and values, and checkpoints hold the adapters alone and resume exactly, in one process."""

from __future__ import annotations

import json
import os

import pytest
import torch

from rlhf.assets import EMBEDDED_MODEL_DIR
from tests.distributed import run_on_ranks
from tests.tiny_lora import FP32, lora_role


def _merged_log_probs_and_values(merged_actor: dict, merged_critic: dict, exp) -> tuple[torch.Tensor, torch.Tensor]:
    """What plain (unadapted) models loaded with the merged weights give on the experience's sequences."""
    from rlhf.models.loading import load_causal_lm
    from rlhf.models.value import load_scalar_head_model, token_values
    from tests.references import sequence_logprobs

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
    from tests.tiny_actor import synthetic_experiences

    torch.manual_seed(0)
    rank = dist.get_rank()
    actor, critic = lora_role("actor", 3), lora_role("critic", 3)
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
    resumed = lora_role("actor", 3)
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
    from rlhf.models.lora import BASE_RECORD, weights_fingerprint
    from rlhf.models.value import last_token_values
    from tests.references import sequence_logprobs

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
    fingerprint = weights_fingerprint(EMBEDDED_MODEL_DIR)
    for role in ("actor", "critic"):  # the base's fingerprint, read from its files (the base is partitioned)
        assert json.loads((tmp_path / role / BASE_RECORD).read_text()) == {
            "base_model_name_or_path": EMBEDDED_MODEL_DIR, "weights_fingerprint": fingerprint}
    main(["--model_path", EMBEDDED_MODEL_DIR, "--lora_path", str(tmp_path / "critic"), "--output_path",
          str(tmp_path / "rm"), "--param_dtype", "fp32", "--is_rm"])
    rm = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm")
    ids = exp.sequences_BT.masked_fill(exp.attention_mask_BT == 0, 0)
    with torch.no_grad():
        scores = rm(input_ids=ids, attention_mask=exp.attention_mask_BT).logits.squeeze(-1)
    want = last_token_values(r["merged_values"], exp.attention_mask_BT)
    torch.testing.assert_close(scores, want, atol=1e-5, rtol=1e-5)


