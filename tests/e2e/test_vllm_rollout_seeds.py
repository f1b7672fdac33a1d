"""Every prompt samples from its own seed in vLLM: per-prompt seeds (torchrun worker), and a global prompt's samples
do not depend on how many engines (or TP ranks) drew them."""

import json

import pytest
import torch

from tests.distributed import run_on_ranks
from tests.rollout_stats import check_first_tokens
from tests.rollout_stats import stat_distribution as model_distribution
from tests.workers import rollout_seeds as worker


@pytest.fixture(scope="module")
def stat_distribution() -> tuple[float, torch.Tensor]:
    return model_distribution()


@pytest.fixture(scope="module")
def one_engine_report(tmp_path_factory, stat_distribution) -> dict:
    """The worker's report on a single engine (world 1)."""
    pytest.importorskip("vllm")
    out = tmp_path_factory.mktemp("seeds") / "one_engine.json"
    run_on_ranks(1, worker.main, str(out), 1, stat_distribution[0], init_group=False)
    return json.loads(out.read_text())


@pytest.mark.vllm
def test_vllm_engine_samples_each_prompt_from_its_own_seed(one_engine_report, stat_distribution):
    report = one_engine_report
    check_first_tokens(report["first_tokens"], report["child_first_tokens"], stat_distribution[1])
    # through the trainer: every response of the repeated prompt in one step differs from the others
    for step in report["steps"].values():
        repeated = [r for p, r in zip(step["prompts"], step["responses"]) if p == worker.STAT_PROMPT]
        assert len(repeated) == 16, step["batch"]
        assert len({tuple(r) for r in repeated}) == len(repeated), step
        assert step["prompts"] == [p for p in step["batch"] for _ in range(4)]


@pytest.mark.vllm
@pytest.mark.parametrize("tp", [1, 2], ids=["two_engines", "one_tp2_engine"])
def test_vllm_samples_do_not_depend_on_the_number_of_engines(tmp_path, one_engine_report, stat_distribution, tp):
    """World 2: two TP-1 engines, or one TP-2 engine, give each global prompt of a step the same samples
    as one engine on one rank; two engines also for 1 prompt (one engine idle) and 3 (shares 1 and 2)."""
    out = tmp_path / "world2.json"
    run_on_ranks(2, worker.main, str(out), tp, stat_distribution[0], init_group=False)
    report = json.loads(out.read_text())
    assert report["steps"].keys() == one_engine_report["steps"].keys()
    for step, expected in one_engine_report["steps"].items():
        got = report["steps"][step]
        assert got["prompts"] == expected["prompts"]
        assert got["responses"] == expected["responses"], step
        assert got["finish_reasons"] == expected["finish_reasons"]
        assert sum(map(len, got["responses"])) > 2 * len(got["responses"])  # not cut short after a token
    if tp == 1:
        assert report["uneven"] == one_engine_report["uneven"]
        assert [len(report["uneven"][n]["prompts"]) for n in ("1", "3")] == [4, 12]
