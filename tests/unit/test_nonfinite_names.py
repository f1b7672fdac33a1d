"""The first non-finite loss term is named in the error."""

from __future__ import annotations

import torch


def test_first_nonfinite_names_the_term():
    from rlhf.engines.deepspeed_engine import first_nonfinite

    assert first_nonfinite({"a": torch.tensor(1.0), "b": None, "c": torch.tensor([0.0, float("inf")]),
                            "d": torch.tensor(float("nan"))}) == "c is inf"
    assert first_nonfinite({"a": torch.tensor(1.0)}) is None
