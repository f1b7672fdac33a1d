"""--use_liger_kernel is refused without CUDA."""

import pytest


def test_liger_kernel_flag_is_refused_without_cuda():
    import torch

    from rlhf.models.loading import apply_liger_kernel, check_liger_kernel

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: tests/gpu/test_gpu_trainer.py covers Liger")
    with pytest.raises(ValueError, match="--use_liger_kernel needs CUDA"):
        check_liger_kernel()
    with pytest.raises(ValueError, match="--use_liger_kernel needs CUDA"):
        apply_liger_kernel(torch.nn.Linear(2, 2))
