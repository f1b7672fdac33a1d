"""The preference launch/examples scripts (2 CPU ranks): DPO, KTO, SimPO and ORPO must rank held-out pairs, so
the figures in the scripts' headers and the README cannot silently go false (`python -m pytest tests/examples
-rP` prints them). The SFT and reward-model examples run as the InstructGPT pipeline's first stages
(tests/examples/test_pipeline_examples.py), not a second time on their own."""

import pytest

from tests.examples.scripts import before_after, run_script


@pytest.mark.parametrize("script", ["dpo_tiny_cpu.sh", "kto_tiny_cpu.sh", "simpo_tiny_cpu.sh", "orpo_tiny_cpu.sh"])
def test_preference_examples_rank_held_out_pairs(tmp_path, script):
    """Held-out pairs whose chosen answer has the higher implicit reward: 0 before for DPO and KTO (policy =
    reference); 0.531 before for the reference-free SimPO and ORPO (the initial policy's average log-probs)."""
    run_script(script, tmp_path / "run", timeout=600)
    _, after = before_after(tmp_path / "run", "eval_acc", script, "held-out accuracy")
    assert after >= 0.85
