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
