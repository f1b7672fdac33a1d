"""The DeepSpeed/transformers patches for ZeRO-3 on role subgroups: a model built on a group without global rank 0
gets the checkpoint's weights, frozen and trainable (4 gloo ranks, one process start)."""


import torch
import torch.distributed as dist

from tests.distributed import run_variants_on_ranks


def _build_on_halves(trainable: bool):
    from rlhf.assets import TINY_DIR
    from rlhf.config.shared_config import EngineConfig, OptimConfig
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


def test_zero3_on_a_group_without_rank_zero_loads_the_checkpoint():
    frozen, trainable = run_variants_on_ranks(4, [(_build_on_halves, False), (_build_on_halves, True)])
    for what, results in (("frozen", frozen), ("trainable", trainable)):
        for output_diff, weight_diff in results:
            assert weight_diff == 0.0, what
            assert output_diff < 1e-5, what
