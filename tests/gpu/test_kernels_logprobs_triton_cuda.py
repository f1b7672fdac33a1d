"""The fused Triton log-prob/entropy kernel natively on CUDA equals the log_softmax references, fp32 and bf16.

Shape legend: N rows, V vocabulary."""


import pytest
import torch

from tests.triton_checks import check_against_reference

pytest.importorskip("triton")


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_triton_kernel_native_cuda(dtype, atol):
    check_against_reference("cuda", dtype, [(64, 1000, 256), (7, 32000, 4096), (3, 128256, 4096)], atol=atol)
