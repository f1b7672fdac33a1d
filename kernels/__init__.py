"""Compute kernels of spmd-rlhf, importable as `rlhf.kernels`. Never imports the rest of `rlhf`.

Each function here has a plain-PyTorch reference that runs on CPU.
"""

from .logprobs import token_logprobs, token_logprobs_reference

__all__ = ["token_logprobs", "token_logprobs_reference"]
