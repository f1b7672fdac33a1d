"""CPU tests for the logic of the CUDA-only paths: what each path decides runs here on fakes (srun local world
sizes, device indices, offload lists, sleep requirements, the weight-push path, IS correction warnings)."""

import pytest
import torch

from rlhf.distributed.launch_env import cuda_device_index, read_launch_env, slurm_local_world_size


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
    from rlhf.config.ppo_config import TrainPPOConfig

    with pytest.warns(UserWarning, match="--enable_vllm_is_correction with --top_p 0.9"):
        parse_config(TrainPPOConfig, ["--enable_vllm_is_correction", "--top_p", "0.9"])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*enable_vllm_is_correction.*")
        parse_config(TrainPPOConfig, ["--enable_vllm_is_correction", "--top_p", "1.0"])
        parse_config(TrainPPOConfig, ["--top_p", "0.9"])
