"""Right after a weight sync, the actor's log-probs and the vLLM engine's log-probs of the same
sampled sequences agree (fp32, max abs difference <= 1e-4), also on multi-turn agent episodes (the
model's tokens of every turn, with the environment's tokens between them)."""

from __future__ import annotations

import json
from contextlib import nullcontext

import pytest

from tests.distributed import exclusive, run_torchrun

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("zero_stage,tp", [(3, 1), (2, 2)])
def test_engine_logprobs_match_actor_after_sync(tmp_path, zero_stage, tp):
    out = tmp_path / "parity.json"
    with exclusive("vllm-tp") if tp > 1 else nullcontext():  # TP > 1 engines share fixed /dev/shm names
        proc = run_torchrun(2, "tests/workers/vllm_parity.py", str(out), str(zero_stage), str(tp))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    report = json.loads(out.read_text())
    assert report["num_tokens"] > 20
    assert report["diff_vs_initial_weights"] > 1e-2, "the sync must have changed the engine's weights"
    assert report["max_abs_diff"] <= 1e-4
    # agent episodes: the model's tokens of every turn, with the environment's tokens between them as context
    assert report["agent_multi_span_rows"] >= 6 and report["agent_env_tokens"] > 0
    assert report["agent_num_tokens"] > 40 and report["agent_max_abs_diff"] <= 1e-4
