"""A rank forked from a preloaded server (the tests' forkserver, as the product launcher's workers are forked from
it) inherits what `rlhf.cli.warm_start.prepare_workers` did once before the fork: vLLM's CPU stand-ins for its
Triton kernels are registered, and a vLLM worker's start (which registers them again, with a scan of every loaded
module) registers nothing; transformers' table of checkpoint conversions is built."""

import pytest
import torch

from tests.distributed import run_on_ranks

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(torch.cuda.is_available(), reason="the ranks are spawned, not forked, with CUDA")]


def _inherited() -> dict:
    import transformers.conversion_mapping as conversion
    import vllm.v1.sample.rejection_sampler as sampler
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON, dispatcher

    from rlhf.engines.vllm_engine import register_cpu_kernels_once

    forked_with = sampler.expand_kernel
    current_platform.register_triton_kernel_overrides()  # what every vLLM worker calls as it starts
    register_cpu_kernels_once()  # what every engine of ours calls before it builds vLLM's
    return {"has_triton": HAS_TRITON,
            "registered": isinstance(forked_with, dispatcher.KernelOverride),
            "wrapped_once": not isinstance(getattr(forked_with, "_impl", None), dispatcher.KernelOverride),
            "unchanged": sampler.expand_kernel is forked_with,
            "conversion_table": conversion._checkpoint_conversion_mapping_cache is not None}


class _Platform:
    """A vLLM platform whose unknown attributes fail loudly (vLLM's answer them through torch's device module, with
    a warning on the console where there is none)."""

    registered = 0

    @classmethod
    def register_triton_kernel_overrides(cls) -> None:
        cls.registered += 1

    def __getattr__(self, key: str):
        raise AssertionError(f"read through the platform's __getattr__: {key}")


def _registers_once_on_a_new_platform() -> int:
    import vllm.platforms

    from rlhf.engines.vllm_engine import register_cpu_kernels_once

    vllm.platforms._current_platform = platform = _Platform()
    for _ in range(3):  # ours, then vLLM's own at each worker start
        register_cpu_kernels_once()
        platform.register_triton_kernel_overrides()
    return _Platform.registered


def test_a_forked_rank_inherits_the_kernel_stand_ins_and_the_conversion_table():
    [state] = run_on_ranks(1, _inherited, init_group=False)
    if state["has_triton"]:  # a Triton with a CPU backend: vLLM registers no stand-ins
        assert not state["registered"]
    else:
        assert state["registered"] and state["wrapped_once"], state
    assert state["unchanged"] and state["conversion_table"], state


def test_the_stand_ins_are_registered_once_per_process_without_the_platforms_fallback_attributes():
    assert run_on_ranks(1, _registers_once_on_a_new_platform, init_group=False) == [1]
