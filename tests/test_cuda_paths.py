"""CPU tests for the logic of the CUDA-only paths (issue 16): what each path decides runs here on fakes,
simulated environments or gloo ranks; what only a GPU can show is in benchmarks/gpu_smoke.sh.

Shape legend: G global packed tokens, N local tokens, H/K query/kv heads, D head dim.
"""

import pytest
import torch
from rlhf.kernels import cu_seqlens_from_lengths, ring_attention, varlen_attention_reference, zigzag_shard

from rlhf.distributed.launch import cuda_device_index, read_launch_env, slurm_local_world_size
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


@pytest.mark.parametrize("nodeid", [0, 1])
def test_srun_two_nodes_local_world_size_is_tasks_on_this_node(nodeid):
    for localid in range(4):
        launch = read_launch_env(_srun_env(4 * nodeid + localid, nodeid, localid))
        assert (launch.launcher, launch.rank, launch.world_size) == ("slurm", 4 * nodeid + localid, 8)
        assert (launch.local_rank, launch.local_world_size, launch.master_addr) == (localid, 4, "gpu01")


def test_srun_uneven_nodes_and_fallbacks():
    # 3 tasks on the first node, 2 on the second: the compressed list is indexed by SLURM_NODEID
    env = {"SLURM_PROCID": "4", "SLURM_NTASKS": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
           "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_STEP_TASKS_PER_NODE": "3,2"}
    assert read_launch_env(env).local_world_size == 2
    assert slurm_local_world_size({"SLURM_NTASKS": "8", "SLURM_TASKS_PER_NODE": "2(x3),1(x2)",
                                   "SLURM_NODEID": "4"}) == 1
    assert slurm_local_world_size({"SLURM_NTASKS": "16", "SLURM_NTASKS_PER_NODE": "8"}) == 8
    assert slurm_local_world_size({"SLURM_NTASKS": "16", "SLURM_NNODES": "2"}) == 8
    assert slurm_local_world_size({"SLURM_NTASKS": "16", "LOCAL_WORLD_SIZE": "4"}) == 4
    with pytest.raises(ValueError, match="export LOCAL_WORLD_SIZE"):
        slurm_local_world_size({"SLURM_NTASKS": "5", "SLURM_NNODES": "2"})
    with pytest.raises(ValueError, match="tasks-per-node list"):
        slurm_local_world_size({"SLURM_NTASKS": "5", "SLURM_TASKS_PER_NODE": "3x2"})


def test_torchrun_local_world_size():
    env = {"RANK": "9", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "h",
           "MASTER_PORT": "1"}
    assert read_launch_env(env).local_world_size == 8


def test_cuda_device_index_all_gpus_or_one_bound_per_task():
    # --gpus-per-node: every task sees the node's 4 GPUs -> its local rank
    assert [cuda_device_index(r, 4, 4) for r in range(4)] == [0, 1, 2, 3]
    # --gpus-per-task=1: CUDA_VISIBLE_DEVICES holds one device per task -> index 0 on both nodes
    for nodeid in (0, 1):
        launches = [read_launch_env(_srun_env(4 * nodeid + r, nodeid, r, CUDA_VISIBLE_DEVICES=str(r)))
                    for r in range(4)]
        assert [cuda_device_index(x.local_rank, x.local_world_size, 1) for x in launches] == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="sees 2 CUDA devices"):
        cuda_device_index(3, 4, 2)


SRUN_INIT_WORKER = """
import json, os, torch, torch.distributed as dist
from rlhf.distributed.launch import init_distributed, read_launch_env
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


# ---- item 1: what --deepspeed_enable_sleep offloads ----------------------------------------------


def test_offload_include_list():
    from rlhf.engines.deepspeed_engine import offload_include

    for stage in (1, 2):
        assert offload_include(stage, adam_offload=False) == ["optim_states", "hp_params", "lp_grads"]
        assert offload_include(stage, adam_offload=True) == []
    assert offload_include(0, False) == offload_include(3, False) == []


def test_sleep_needs_stage12_offload_states_at_start_up(monkeypatch):
    """--deepspeed_enable_sleep at ZeRO-1/2 is refused before any model is built when the installed DeepSpeed's
    stage-1/2 optimizer has no offload_states; stage 3 and --adam_offload do not need it."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from rlhf.config.errors import UsageError
    from rlhf.engines.deepspeed_engine import check_sleep_supported

    check_sleep_supported(2, adam_offload=False)  # the installed DeepSpeed has it
    monkeypatch.delattr(DeepSpeedZeroOptimizer, "offload_states")
    with pytest.raises(UsageError, match=r"--deepspeed_enable_sleep at --zero_stage 1/2 needs DeepSpeed >= 0\.17\.6"):
        check_sleep_supported(1, adam_offload=False)
    check_sleep_supported(2, adam_offload=True)
    check_sleep_supported(3, adam_offload=False)


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
    from rlhf.config.common import EngineConfig, OptimConfig
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


# ---- items 2 and 3: vLLM weight-push path and sleep/wake order, on a stand-in for vllm.LLM -------------


class _FakeRunner:
    def __init__(self, log: list, new_signature: bool) -> None:
        self.log = log
        self.model = self
        if new_signature:
            self.reload_weights = self._reload_weights_new

    def _reload_weights_new(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True) -> None:
        self.log.append(("reload_weights", [name for name, _ in weights_iterator]))

    def reload_weights(self) -> None:  # vLLM before in-place reloads: re-reads the checkpoint
        self.log.append(("reload_from_disk", []))

    def load_weights(self, weights) -> None:
        self.log.append(("load_weights", [name for name, _ in weights]))


class _FakeLLM:
    """The vllm.LLM methods VLLMEngine uses; `collective_rpc` runs on one in-process worker, as vLLM's
    uniprocess executor does (a callable gets the worker as its first argument)."""

    def __init__(self, new_signature: bool) -> None:
        self.log: list = []
        self.model_runner = _FakeRunner(self.log, new_signature)

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        fn = getattr(self.model_runner, method) if isinstance(method, str) else (lambda *a, **k: method(self, *a, **k))
        return [fn(*args, **(kwargs or {}))]

    def sleep(self, level: int = 1) -> None:
        self.log.append(("sleep", level))

    def wake_up(self, tags=None) -> None:
        self.log.append(("wake_up", tuple(tags)))

    def reset_prefix_cache(self) -> None:
        self.log.append(("reset_prefix_cache",))


WEIGHTS = [("model.embed_tokens.weight", torch.ones(2)), ("lm_head.weight", torch.ones(2))]


@pytest.mark.parametrize("new_signature", [True, False])
def test_weight_push_path_chosen_from_the_signature_at_start_up(new_signature):
    from rlhf.engines.vllm_engine import LOAD_WEIGHTS, RELOAD_IN_PLACE, VLLMEngine

    llm = _FakeLLM(new_signature)
    engine = VLLMEngine.from_llm(llm, sleep_enabled=False)
    assert engine.push_path == (RELOAD_IN_PLACE if new_signature else LOAD_WEIGHTS)
    engine.load_weights(iter(WEIGHTS))
    names = [name for name, _ in WEIGHTS]
    pushed = ("reload_weights", names) if new_signature else ("load_weights", names)
    assert llm.log == [pushed, ("reset_prefix_cache",)]  # one call with every tensor; no sleep/wake when off


def test_real_vllm_takes_the_in_place_reload():
    pytest.importorskip("vllm")
    import inspect

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from rlhf.engines.vllm_engine import RELOAD_IN_PLACE, weight_push_path

    assert weight_push_path(list(inspect.signature(GPUModelRunner.reload_weights).parameters)) == RELOAD_IN_PLACE


def test_sleep_after_build_then_weights_push_empty_cache_kv_cache():
    from rlhf.engines.vllm_engine import VLLMEngine

    llm = _FakeLLM(new_signature=True)
    engine = VLLMEngine.from_llm(llm, sleep_enabled=True)
    assert llm.log == [("sleep", 2)]  # asleep before DeepSpeed builds anything
    # the trainer's order: initial push; then per step generate, sleep, (train), wake_up, push
    engine.load_weights(iter(WEIGHTS))
    engine.sleep()
    engine.wake_up()
    engine.load_weights(iter(WEIGHTS))
    names = [name for name, _ in WEIGHTS]
    push = [("wake_up", ("weights",)), ("reload_weights", names), ("reset_prefix_cache",), ("wake_up", ("kv_cache",))]
    assert llm.log == [("sleep", 2), *push, ("sleep", 2), *push]
    assert engine.asleep == set()


# ---- item 7: vLLM importance-sampling correction under top_p < 1 --------------------------------------


def test_is_correction_with_top_p_below_one_warns():
    import warnings

    from rlhf.config.flags import parse_config
    from rlhf.config.ppo import TrainPPOConfig

    with pytest.warns(UserWarning, match="--enable_vllm_is_correction with --top_p 0.9"):
        parse_config(TrainPPOConfig, ["--enable_vllm_is_correction", "--top_p", "0.9"])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*enable_vllm_is_correction.*")
        parse_config(TrainPPOConfig, ["--enable_vllm_is_correction", "--top_p", "1.0"])
        parse_config(TrainPPOConfig, ["--top_p", "0.9"])
