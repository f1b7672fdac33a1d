"""The fused Triton log-prob/entropy kernel equals the log_softmax references, forward and backward, under Triton's
interpreter in a subprocess (TRITON_INTERPRET=1 must be set before the kernel module is imported, and bf16 is
silently wrong there, so only fp32 is checked); without the interpreter a CPU tensor is refused.

Shape legend: N rows, V vocabulary."""

import os
import subprocess
import sys

import pytest
import torch

from tests.distributed import ROOT

pytest.importorskip("triton")


def test_triton_kernel_interpreted_on_cpu_fp32():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": ROOT}
    code = "from tests.triton_checks import interpreted_fp32_checks; interpreted_fp32_checks()"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "interpreted fp32 checks passed" in proc.stdout


def test_triton_kernel_refuses_cpu_without_interpreter():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process runs Triton's interpreter")
    from rlhf.kernels.logprobs_triton import fused_logprobs_entropy

    with pytest.raises(RuntimeError, match="chunked_logprobs_entropy"):
        fused_logprobs_entropy(torch.randn(2, 8), torch.tensor([1, 2]))
