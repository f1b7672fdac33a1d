"""OpenRLHF's DeepSpeed tuning flags on a real engine (4 gloo ranks, one process start): --zpg 2 at ZeRO-3 keeps
ZeRO++ secondary partitions over pairs of ranks (the topology's groups, not DeepSpeed's world-wide ones) and
trains exactly as --zpg 1; --grad_accum_dtype fp32 with bf16 weights at ZeRO-2 accumulates in float32 and steps;
--gradient_checkpointing_use_reentrant reaches the model's checkpoint function."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.distributed import run_variants_on_ranks

IDS = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 3]])


def _model(engine, *, bf16: bool = False, reentrant: bool = False):
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
                          gradient_checkpointing=reentrant, checkpoint_reentrant=reentrant)


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


def test_zpg_and_grad_accum_dtype_on_deepspeed():
    plain, hpz, fp32 = run_variants_on_ranks(4, [(zero3, 1), (zero3, 2), (accumulate_in_fp32,)])
    for rank in range(4):
        assert plain[rank]["layout"] == (4, 1) and hpz[rank]["layout"] == (2, 2)
        assert hpz[rank]["losses"] == plain[rank]["losses"]
        for name, weight in plain[rank]["weights"].items():
            torch.testing.assert_close(hpz[rank]["weights"][name], weight, rtol=0, atol=0)
        assert fp32[rank]["accum_dtype"] == torch.float32 and fp32[rank]["moved"]
        assert fp32[rank]["reentrant"] == {True}
        assert all(torch.isfinite(torch.tensor(fp32[rank]["losses"])))
