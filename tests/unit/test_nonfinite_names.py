"""The first non-finite loss term is named in the error."""

from __future__ import annotations

import torch


def test_first_nonfinite_names_the_term():
    from rlhf.engines.deepspeed_engine import first_flagged, nonfinite_flags

    def first_nonfinite(terms):
        return first_flagged([nonfinite_flags(terms)])

    assert first_nonfinite({"a": torch.tensor(1.0), "b": None, "c": torch.tensor([0.0, float("inf")]),
                            "d": torch.tensor(float("nan"))}) == "c is inf"
    assert first_nonfinite({"a": torch.tensor(1.0)}) is None
    # over a step's micro-batches: the first micro-batch with a non-finite term names it
    step = [nonfinite_flags({"a": torch.tensor(1.0)}), nonfinite_flags({"b": torch.tensor(float("nan"))}),
            nonfinite_flags({"c": torch.tensor(float("inf"))})]
    assert first_flagged(step) == "b is nan"


def test_all_finite_agrees_with_the_element_wise_check():
    """`all_finite` (the gradient partition's check before each update, and the weights' before a save) answers as
    `isfinite(t).all()` does, including finite values whose sum overflows (then the element-wise check decides)."""
    from rlhf.engines.deepspeed_engine import all_finite

    inf, nan, big = float("inf"), float("nan"), 3e38
    cases = [torch.randn(1000), torch.tensor([]), torch.tensor([1.0, nan]), torch.tensor([inf, 1.0]),
             torch.tensor([-inf, inf]), torch.tensor([big, big]), torch.tensor([big, big, nan]),
             torch.tensor([-big, -big, 1.0]), torch.tensor([60000.0, 60000.0], dtype=torch.float16),
             torch.tensor([60000.0, inf], dtype=torch.float16), torch.tensor([1.0, 2.0], dtype=torch.bfloat16),
             torch.full((3, 4), nan, dtype=torch.bfloat16)]
    for t in cases:
        assert all_finite(t) == bool(torch.isfinite(t).all()), t
    assert all_finite(torch.tensor([big, big])) and not bool(torch.isfinite(torch.tensor([big, big]).sum()))
