"""Right after a weight sync, the actor's log-probs and the vLLM engine's log-probs of the same
sampled sequences agree (fp32, max abs difference <= 1e-4), also on multi-turn agent episodes (the
model's tokens of every turn, with the environment's tokens between them). The TP-2 engine starts beside the
shared-memory segments a killed TP-2 run leaves under vLLM's own names (which made the next run fail: EEXIST)."""

from __future__ import annotations

import json
import os

import pytest

from tests.distributed import run_on_ranks
from tests.workers import vllm_parity

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

UNTAGGED_SHM = ["/dev/shm/-tp:0-[0-1]-cpushm_0", "/dev/shm/-tp:0-[0-1]-cpushm_1"]
"""vLLM's CPU TP-2 segment names without the run tag (`rlhf.engines.vllm_engine.tag_cpu_shm_names`)."""


@pytest.mark.parametrize("zero_stage,tp", [(3, 1), (2, 2)])
def test_engine_logprobs_match_actor_after_sync(tmp_path, zero_stage, tp):
    out = tmp_path / "parity.json"
    left_by_a_killed_run = [p for p in UNTAGGED_SHM if tp > 1 and not os.path.exists(p)]
    try:
        for path in left_by_a_killed_run:
            with open(path, "wb") as f:
                f.write(bytes(4096))
        run_on_ranks(2, vllm_parity.main, str(out), zero_stage, tp, init_group=False)
    finally:
        for path in left_by_a_killed_run:
            os.remove(path)
    report = json.loads(out.read_text())
    assert report["num_tokens"] > 20
    assert report["diff_vs_initial_weights"] > 1e-2, "the sync must have changed the engine's weights"
    assert report["max_abs_diff"] <= 1e-4
    # agent episodes: the model's tokens of every turn, with the environment's tokens between them as context
    assert report["agent_multi_span_rows"] >= 6 and report["agent_env_tokens"] > 0
    assert report["agent_num_tokens"] > 40 and report["agent_max_abs_diff"] <= 1e-4
