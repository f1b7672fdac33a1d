"""A non-finite loss never reaches the weights: every rank stops at the same optimizer step with the
same message, or (--max_nonfinite_steps) skips the update and trains on as if it had not happened."""

from __future__ import annotations

import torch


def test_first_nonfinite_names_the_term():
    from rlhf.engines.deepspeed_engine import first_nonfinite

    assert first_nonfinite({"a": torch.tensor(1.0), "b": None, "c": torch.tensor([0.0, float("inf")]),
                            "d": torch.tensor(float("nan"))}) == "c is inf"
    assert first_nonfinite({"a": torch.tensor(1.0)}) is None
