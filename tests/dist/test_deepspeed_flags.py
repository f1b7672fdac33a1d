"""OpenRLHF's DeepSpeed tuning flags on a real engine (4 gloo ranks, one process start): --zpg 2 at ZeRO-3 keeps
ZeRO++ secondary partitions over pairs of ranks (the topology's groups, not DeepSpeed's world-wide ones) and
trains exactly as --zpg 1; --grad_accum_dtype fp32 with bf16 weights at ZeRO-2 accumulates in float32 and steps;
--gradient_checkpointing_use_reentrant reaches the model's checkpoint function; --enable_ema's average (ZeRO-3:
of each rank's partitions) equals the hand-computed average of the weights after each step when saved, and
survives a checkpoint round trip."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.distributed import run_variants_on_ranks

IDS = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 3]])


def _model(engine, *, bf16: bool = False, reentrant: bool = False, ema_beta: float | None = None):
    from rlhf.assets import EMBEDDED_MODEL_DIR
    from rlhf.config.shared_config import OptimConfig
    from rlhf.distributed.topology import Role, Topology
    from rlhf.engines.deepspeed_engine import DeepSpeedModel
    from rlhf.models.loading import load_causal_lm

    topology = Topology({Role.ACTOR: tuple(range(dist.get_world_size()))}, hpz_size=engine.hpz_size)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if bf16 else torch.float32
    return DeepSpeedModel(lambda: load_causal_lm(EMBEDDED_MODEL_DIR, dtype, "sdpa"), engine,
                          OptimConfig(lr_warmup_ratio=0.0, lr_scheduler="constant"), learning_rate=1e-2, bf16=bf16,
                          micro_batch_size=2, grad_accum_steps=1, num_optimizer_steps=2, device=torch.device("cpu"),
                          dp_group=topology.group(Role.ACTOR), hpz_group=topology.hpz_group(Role.ACTOR),
                          gradient_checkpointing=reentrant, checkpoint_reentrant=reentrant, ema_beta=ema_beta)


def _train(model, steps: int = 2) -> list[float]:
    losses = []
    for _ in range(steps):
        model.train()
        loss = model.engine(input_ids=IDS, attention_mask=torch.ones_like(IDS)).logits.float().logsumexp(-1).mean()
        model.backward(loss, last_micro_batch=True)
        assert model.step()
        losses.append(float(loss.detach()))
    return losses


def zero3(zpg: int) -> dict:
    from rlhf.config.shared_config import EngineConfig

    model = _model(EngineConfig(zero_stage=3, zpg=zpg))
    first = next(model.module.parameters())
    layout = (first.ds_secondary_tensor_group_size, first.ds_secondary_tensor_num_of_groups)
    losses = _train(model)
    return {"losses": losses, "layout": layout, "weights": {n: t for n, t in model.full_parameters()}}


def accumulate_in_fp32() -> dict:
    from rlhf.config.shared_config import EngineConfig

    model = _model(EngineConfig(zero_stage=2, grad_accum_dtype="fp32"), bf16=True, reentrant=True)
    before = {n: t for n, t in model.full_parameters()}
    losses = _train(model, steps=1)
    after = dict(model.full_parameters())
    return {"accum_dtype": model.engine.optimizer.gradient_accumulation_dtype, "losses": losses,
            "moved": any(not torch.equal(before[n], after[n]) for n in before),
            "reentrant": {m._gradient_checkpointing_func.keywords["use_reentrant"] for m in model.module.modules()
                          if hasattr(m, "_gradient_checkpointing_func")}}


def ema_round_trip(zero_stage: int, out: str) -> dict:
    """Two steps with beta 0.5: the saved model is 0.25 w0 + 0.25 w1 + 0.5 w2 (w0 the initial weights); a fresh
    engine that loads the checkpoint holds the same averages."""
    from safetensors.torch import load_file

    from rlhf.assets import EMBEDDED_MODEL_DIR
    from rlhf.config.shared_config import EngineConfig
    from rlhf.models.loading import load_tokenizer

    model = _model(EngineConfig(zero_stage=zero_stage), ema_beta=0.5)
    weights = [dict(model.full_parameters())]
    for _ in range(2):
        _train(model, steps=1)
        weights.append(dict(model.full_parameters()))
    expected = {n: 0.25 * weights[0][n] + 0.25 * weights[1][n] + 0.5 * weights[2][n] for n in weights[0]}
    model.save_hf(f"{out}/model", load_tokenizer(EMBEDDED_MODEL_DIR), is_writer=dist.get_rank() == 0)
    model.save_state(f"{out}/state")
    dist.barrier()
    saved = load_file(f"{out}/model/model.safetensors")
    restored = _model(EngineConfig(zero_stage=zero_stage), ema_beta=0.5)
    restored.load_state(f"{out}/state")
    return {"error": max(float((saved[n] - expected[n]).abs().max()) for n in saved),
            "moved": max(float((weights[2][n] - expected[n]).abs().max()) for n in saved),
            "saved": sorted(saved) == sorted(n for n in expected if n in saved) and len(saved) > 0,
            "restored": all(torch.equal(restored.ema.averages[n], a) for n, a in model.ema.averages.items())}


def test_zpg_and_grad_accum_dtype_on_deepspeed(tmp_path):
    plain, hpz, fp32, ema3, ema2 = run_variants_on_ranks(4, [
        (zero3, 1), (zero3, 2), (accumulate_in_fp32,), (ema_round_trip, 3, str(tmp_path / "z3")),
        (ema_round_trip, 2, str(tmp_path / "z2"))])
    for rank in range(4):
        assert plain[rank]["layout"] == (4, 1) and hpz[rank]["layout"] == (2, 2)
        assert hpz[rank]["losses"] == plain[rank]["losses"]
        for name, weight in plain[rank]["weights"].items():
            torch.testing.assert_close(hpz[rank]["weights"][name], weight, rtol=0, atol=0)
        assert fp32[rank]["accum_dtype"] == torch.float32 and fp32[rank]["moved"]
        assert fp32[rank]["reentrant"] == {True}
        assert all(torch.isfinite(torch.tensor(fp32[rank]["losses"])))
        for ema in (ema3[rank], ema2[rank]):
            assert ema["saved"] and ema["restored"]
            assert ema["error"] < 1e-6 < ema["moved"]  # the average, not the last weights
