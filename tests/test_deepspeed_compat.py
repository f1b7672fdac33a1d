"""The DeepSpeed/transformers patches for ZeRO-3 on role subgroups: the patched calls still exist where
we patch them, and a model built on a group without global rank 0 gets the checkpoint's weights."""

import inspect

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_on_ranks


def test_patched_calls_are_still_where_we_patch_them():
    import transformers.integrations.deepspeed as hf_deepspeed
    from deepspeed.runtime.zero import partitioned_param_coordinator, stage3
    from transformers.modeling_utils import set_zero3_state  # noqa: F401 - must exist

    assert hasattr(partitioned_param_coordinator, "assert_ints_same_as_other_ranks")
    assert "dist.barrier()" in inspect.getsource(stage3.DeepSpeedZeroOptimizer_Stage3._setup_for_real_optimizer)
    assert "torch.distributed.get_rank() == 0" in inspect.getsource(hf_deepspeed._load_state_dict_into_zero3_model)


def _build_on_halves(trainable: bool):
    from rlhf.assets import TINY_DIR
    from rlhf.config.common import EngineConfig, OptimConfig
    from rlhf.engines.deepspeed_compat import install_subgroup_patches
    from rlhf.engines.deepspeed_engine import DeepSpeedModel, GroupMPU
    from rlhf.models.value import last_token_values, load_scalar_head_model

    install_subgroup_patches()
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    singles = [dist.new_group([r]) for r in range(4)]
    rank = dist.get_rank()
    group = halves[rank // 2]
    path = f"{TINY_DIR}/reward_model"
    model = DeepSpeedModel(lambda: load_scalar_head_model(path, "score", torch.float32, "sdpa"),
                           EngineConfig(zero_stage=3), OptimConfig(), learning_rate=1e-3, bf16=False,
                           micro_batch_size=2, grad_accum_steps=1, num_optimizer_steps=1, device=torch.device("cpu"),
                           dp_group=group, mpu=GroupMPU(group, singles[rank]), trainable=trainable)
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 3]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        sharded = last_token_values(model.engine(ids, mask), mask)
        plain_model = load_scalar_head_model(path, "score", torch.float32, "sdpa")
        plain = last_token_values(plain_model(ids, mask), mask)
    full = dict(model.full_parameters())
    weight_diff = max(float((full[k] - v).abs().max()) for k, v in plain_model.state_dict().items())
    return float((sharded - plain).abs().max()), weight_diff


@pytest.mark.parametrize("trainable", [pytest.param(False, marks=pytest.mark.long), True])
def test_zero3_on_a_group_without_rank_zero_loads_the_checkpoint(trainable):
    for output_diff, weight_diff in run_on_ranks(4, _build_on_halves, trainable):
        assert weight_diff == 0.0
        assert output_diff < 1e-5
