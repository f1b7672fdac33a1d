"""CPU checks of CUDA-path logic that need several gloo processes: ring attention on the world group, the node-local
world size exported under simulated srun nodes, and DeepSpeed offload keeping the low-precision weights."""

import torch
from rlhf.kernels import cu_seqlens_from_lengths, ring_attention, varlen_attention_reference, zigzag_shard

from tests.distributed import run_on_ranks

# ---- item 5: ring attention with group=None -----------------------------------------------------


def _ring_default_group_worker() -> tuple[torch.Tensor, torch.Tensor]:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    cu_G = cu_seqlens_from_lengths([8, 16])
    g = torch.Generator().manual_seed(0)
    q_GHD, k_GKD, v_GKD = (torch.randn(24, h, 8, generator=g) for h in (4, 2, 2))
    reference_GHD = varlen_attention_reference(q_GHD, k_GKD, v_GKD, cu_G, causal=True)
    q_NHD, k_NKD, v_NKD = (zigzag_shard(t, cu_G, rank, world) for t in (q_GHD, k_GKD, v_GKD))
    out_NHD = ring_attention(q_NHD, k_NKD, v_NKD, cu_G, None, causal=True)
    return out_NHD, zigzag_shard(reference_GHD, cu_G, rank, world)


def test_ring_attention_group_none_is_the_world_group():
    for out_NHD, expected_NHD in run_on_ranks(2, _ring_default_group_worker):
        torch.testing.assert_close(out_NHD, expected_NHD, atol=1e-5, rtol=1e-5)


# ---- item 6: SLURM environment ------------------------------------------------------------------


def _srun_env(procid: int, nodeid: int, localid: int, **extra: str) -> dict[str, str]:
    """What srun exports to a task of `srun --nodes 2 --ntasks-per-node 4` (8 tasks) on node `nodeid`."""
    return {"SLURM_PROCID": str(procid), "SLURM_NTASKS": "8", "SLURM_LOCALID": str(localid),
            "SLURM_NODEID": str(nodeid), "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu[01-02]",
            "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_TASKS_PER_NODE": "4(x2)", **extra}


SRUN_INIT_WORKER = """
import json, os, torch, torch.distributed as dist
from rlhf.distributed.launch_env import init_distributed, read_launch_env
launch = read_launch_env()
init_distributed(launch)
print(json.dumps({"local_world_size": os.environ["LOCAL_WORLD_SIZE"], "local_rank": os.environ["LOCAL_RANK"]}))
dist.destroy_process_group()
"""


def test_init_distributed_exports_the_node_local_world_size(tmp_path):
    """Two simulated nodes of 1 task each (2 tasks): LOCAL_WORLD_SIZE exported as 1, not the world size."""
    import json
    import os
    import subprocess
    import sys

    from tests.distributed import ROOT, free_port

    port = free_port()
    procs = []
    for node in (0, 1):
        env = {**os.environ, **_srun_env(node, node, 0), "SLURM_NTASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PYTHONPATH": ROOT}
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            env.pop(key, None)
        procs.append(subprocess.Popen([sys.executable, "-c", SRUN_INIT_WORKER], env=env, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        assert json.loads(out.strip().splitlines()[-1]) == {"local_world_size": "1", "local_rank": "0"}


def _train_step(model, ids_BT: torch.Tensor) -> None:
    model.train()
    model.backward(model.engine(input_ids=ids_BT).logits.float().logsumexp(-1).mean(), True)
    model.step()


def _forward_BTV(model, ids_BT: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model.engine(input_ids=ids_BT).logits


def _offload_then_forward(cases: list[tuple[int, bool]]) -> list[dict]:
    """Per (zero stage, adam_offload): train a step, offload, run a forward (the next experience pass), reload,
    train again; report what moved and whether the forward saw the same weights."""
    import torch.distributed as dist

    from rlhf.assets import EMBEDDED_MODEL_DIR
    from rlhf.config.shared_config import EngineConfig, OptimConfig
    from rlhf.engines.deepspeed_engine import DeepSpeedModel
    from rlhf.models.loading import load_causal_lm

    results = []
    for zero_stage, adam_offload in cases:
        torch.manual_seed(0)
        model = DeepSpeedModel(lambda: load_causal_lm(EMBEDDED_MODEL_DIR, torch.float32, "sdpa"),
                               EngineConfig(zero_stage=zero_stage, adam_offload=adam_offload),
                               OptimConfig(lr_warmup_ratio=0.0, lr_scheduler="constant"), learning_rate=1e-2,
                               bf16=False, micro_batch_size=2, grad_accum_steps=1, num_optimizer_steps=2,
                               device=torch.device("cpu"), dp_group=dist.group.WORLD)
        vocab = model.module.config.vocab_size
        ids_BT = torch.randint(3, vocab, (2, 12), generator=torch.Generator().manual_seed(0))

        _train_step(model, ids_BT)
        before_BTV = _forward_BTV(model, ids_BT)
        zero = model.engine.optimizer
        masters = zero.single_partition_of_fp32_groups if zero_stage < 3 else zero.fp32_partitioned_groups_flat
        master_ptrs = [t.data_ptr() for t in masters]
        param_ptrs = [p.data_ptr() for p in model.module.parameters()]
        model.offload()
        offloaded = sorted(str(s.value) for s in getattr(zero, "offloaded_states", ()))
        masters_moved = [t.data_ptr() for t in masters] != master_ptrs
        params_kept = [p.data_ptr() for p in model.module.parameters()] == param_ptrs
        during_BTV = _forward_BTV(model, ids_BT)
        model.reload(torch.device("cpu"))
        steps_on_host = all(s["step"].device.type == "cpu" for s in zero.optimizer.state.values() if "step" in s)
        _train_step(model, ids_BT)
        results.append({"offloaded": offloaded, "masters_moved": masters_moved, "params_kept": params_kept,
                        "forward_same": bool(torch.equal(before_BTV, during_BTV)), "steps_on_host": steps_on_host,
                        "finite_after": bool(torch.isfinite(_forward_BTV(model, ids_BT)).all())})
    return results


def test_offload_keeps_the_low_precision_weights_and_forward_runs_after_offload():
    cases = [(2, False), (2, True), (3, False), (3, True)]
    stage2, stage2_adam_offload, stage3, stage3_adam_offload = run_on_ranks(1, _offload_then_forward, cases)[0]
    assert stage2["offloaded"] == ["hp_params", "lp_grads", "optim_states"]  # never lp_params
    assert stage2["masters_moved"] and stage2["params_kept"] and stage2["forward_same"]
    assert stage2_adam_offload["offloaded"] == [] and not stage2_adam_offload["masters_moved"]
    assert stage3["masters_moved"] and stage3["forward_same"]
    assert not stage3_adam_offload["masters_moved"]  # already on the host: --adam_offload skips the move
    for result in (stage2, stage2_adam_offload, stage3, stage3_adam_offload):
        assert result["steps_on_host"] and result["finite_after"] and result["forward_same"]


def _offloaded_adam_steps() -> list[dict]:
    """ZeRO-2 and ZeRO-3 with --adam_offload: which AdamW the engine built, and the weights after two steps."""
    import torch.distributed as dist

    from rlhf.assets import EMBEDDED_MODEL_DIR
    from rlhf.config.shared_config import EngineConfig, OptimConfig
    from rlhf.engines.deepspeed_engine import DeepSpeedModel
    from rlhf.models.loading import load_causal_lm

    results = []
    for zero_stage, adam_offload in [(2, True), (3, True), (2, False)]:
        model = DeepSpeedModel(lambda: load_causal_lm(EMBEDDED_MODEL_DIR, torch.float32, "sdpa"),
                               EngineConfig(zero_stage=zero_stage, adam_offload=adam_offload),
                               OptimConfig(lr_warmup_ratio=0.0, lr_scheduler="constant", adam_betas=(0.9, 0.95),
                                           l2=0.0), learning_rate=1e-2, bf16=False, micro_batch_size=2,
                               grad_accum_steps=1, num_optimizer_steps=2, device=torch.device("cpu"),
                               dp_group=dist.group.WORLD)
        ids_BT = torch.randint(3, model.module.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
        for _ in range(2):
            _train_step(model, ids_BT)
        results.append({"fused": model.engine.optimizer.optimizer.defaults["fused"],
                        "weights": dict(model.full_parameters())})
    return results


def test_adam_offload_steps_with_the_fused_host_adam():
    """--adam_offload: torch's fused AdamW over the host partitions (`fused_adam`), its two steps equal to the
    plain model's with the default AdamW (within the rounding AdamW allows); without offload the default."""
    from rlhf.assets import EMBEDDED_MODEL_DIR
    from rlhf.models.loading import load_causal_lm
    from tests.tiny_runs import assert_adam_weights_close

    stage2, stage3, plain_engine = run_on_ranks(1, _offloaded_adam_steps)[0]
    assert stage2["fused"] is True and stage3["fused"] is True and plain_engine["fused"] is None
    model = load_causal_lm(EMBEDDED_MODEL_DIR, torch.float32, "sdpa")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)
    ids_BT = torch.randint(3, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        model(input_ids=ids_BT).logits.float().logsumexp(-1).mean().backward()  # `_train_step`'s loss
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    want = {n: p.detach() for n, p in model.named_parameters()}
    for what, got in (("ZeRO-2 offload", stage2), ("ZeRO-3 offload", stage3), ("ZeRO-2", plain_engine)):
        assert_adam_weights_close(want, got["weights"], 1e-2, 2, what=what)
