"""The DeepSpeed/transformers calls that the ZeRO-3 subgroup patches replace still exist where we patch them."""

import inspect


def test_patched_calls_are_still_where_we_patch_them():
    import transformers.integrations.deepspeed as hf_deepspeed
    from deepspeed.runtime.zero import partitioned_param_coordinator, stage3
    from transformers.modeling_utils import set_zero3_state  # noqa: F401 - must exist

    assert hasattr(partitioned_param_coordinator, "assert_ints_same_as_other_ranks")
    assert "dist.barrier()" in inspect.getsource(stage3.DeepSpeedZeroOptimizer_Stage3._setup_for_real_optimizer)
    assert "torch.distributed.get_rank() == 0" in inspect.getsource(hf_deepspeed._load_state_dict_into_zero3_model)
    # --zpg: DeepSpeed reads its ZeRO++ group from this module global while a model is built (hpz_scoped_to)
    from deepspeed.runtime.zero import partition_parameters
    from deepspeed.utils import groups

    assert hasattr(groups, "_ZERO_PARAM_INTRA_PARALLEL_GROUP")
    assert "zero_param_parallel_group" in inspect.signature(partition_parameters.Init).parameters
    assert "groups._get_zero_param_intra_parallel_group()" in inspect.getsource(stage3.DeepSpeedZeroOptimizer_Stage3)


def test_arch_lists_with_arch_specific_entries_are_built_by_deepspeed(monkeypatch, capsys):
    """CUDA images for Hopper set TORCH_CUDA_ARCH_LIST to entries like 9.0a, which DeepSpeed's JIT builder cannot
    parse (it failed --deepcompile on an H200 with `invalid literal for int() with base 10: '0a'`)."""
    import os

    from deepspeed.ops.op_builder.dc import DeepCompileBuilder

    from rlhf.engines.deepspeed_compat import arch_list_deepspeed_reads, arch_list_for_deepspeed_builds

    assert arch_list_deepspeed_reads("8.0;9.0a 10.0f+PTX;9.0") == "8.0;9.0;10.0+PTX"
    assert arch_list_deepspeed_reads("8.6") == "8.6"
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0a")
    builder = DeepCompileBuilder()
    builder.jit_mode = True
    with arch_list_for_deepspeed_builds(rank=0):
        builder.compute_capability_args()  # raised ValueError on "9.0a"
        built_for = os.environ["TORCH_CUDA_ARCH_LIST"]
    assert built_for == "8.0;9.0+PTX"  # DeepSpeed's builder adds +PTX to the newest
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0a"  # the user's value afterwards
    assert "DeepCompile's op is built for '8.0;9.0'" in capsys.readouterr().out
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    with arch_list_for_deepspeed_builds(rank=0):
        assert os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0"
    assert capsys.readouterr().out == ""
