"""Multi-turn agent rollouts (`rlhf.agents`, `--agent_func_path`): the episode loop against a scripted engine
(token-in-token-out, the action mask with several spans, limits, seeds, both agent-file forms), the rollout record
and rewards built from episodes, returns across turns, and the flags."""

import random
import textwrap

import pytest
import torch

from rlhf.agents import AgentRewards, TurnLimits, load_agent, run_episodes, turn_seed
from rlhf.agents.interface import parse_step
from rlhf.algorithms.advantages import discounted_returns, gae, token_rewards
from rlhf.data.records import EpisodeOutcome
from rlhf.engines.rollout import Generation, SamplingSpec, to_rollout
from rlhf.rewards.base import RewardInputs


class ScriptedEngine:
    """Each request draws `spec.max_tokens` (at most 3) token ids from random.Random(seed): digits 9..18."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[list[int]], int, list[int]]] = []

    def generate(self, prompts, spec, seeds):
        assert spec.n == 1
        self.calls.append(([list(p) for p in prompts], spec.max_tokens, list(seeds)))
        out = []
        for seed in seeds:
            rng = random.Random(seed)
            ids = [rng.randrange(9, 19) for _ in range(min(spec.max_tokens, 3))]
            out.append([Generation(ids, [-0.5 - i for i in range(len(ids))], "length")])
        return out


@pytest.fixture(scope="module")
def tokenizer():
    from rlhf.assets import EMBEDDED_MODEL_DIR
    from rlhf.models.loading import load_tokenizer

    return load_tokenizer(EMBEDDED_MODEL_DIR, False)


def _agent(tmp_path, body: str, name: str = "agent.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return load_agent(str(path))


THREE_TURNS = """
    import asyncio
    async def step(observation, action, label, **kwargs):
        await asyncio.sleep(0)
        turn = kwargs["turn"]
        return {"rewards": 0.25 * (turn + 1), "scores": float(turn), "done": turn == 2,
                "environment_feedback": "" if turn == 2 else " copy " + label + " :",
                "extra_logs": {"turn": turn}}
"""


def _run(engine, agent, tokenizer, prompts, labels, n=1, seeds=None, **limits):
    spec = SamplingSpec(n=n, temperature=1.0, top_p=1.0, max_tokens=99)
    seeds = seeds or [1000 + i for i in range(len(prompts))]
    return run_episodes(engine, agent, tokenizer, prompts, ["p"] * len(prompts), labels, spec, seeds,
                        TurnLimits(**{"max_total": 64, **limits}))


def test_episode_is_token_in_token_out_with_one_action_span_per_turn(tmp_path, tokenizer):
    engine, agent = ScriptedEngine(), _agent(tmp_path, THREE_TURNS)
    prompt = [2, 19, 5]
    (gens,), outcomes = _run(engine, agent, tokenizer, [prompt], ["7"])
    feedback = tokenizer(" copy 7 :", add_special_tokens=False)["input_ids"]
    assert len(feedback) == 3
    turns = [call[0][0] for call in engine.calls]
    actions = [turns[1][len(prompt):len(prompt) + 3], turns[2][len(prompt) + 6:len(prompt) + 9]]
    # each turn's context is exactly the previous context + the engine's ids + the environment's ids
    assert turns[0] == prompt and turns[1] == prompt + actions[0] + feedback
    assert turns[2] == turns[1] + actions[1] + feedback
    (g,) = gens
    assert g.token_ids[:-3] == turns[2][len(prompt):] and len(g.token_ids) == 15
    assert g.action_mask == [1, 1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1]
    assert g.logprobs == [-0.5, -1.5, -2.5, 0, 0, 0, -0.5, -1.5, -2.5, 0, 0, 0, -0.5, -1.5, -2.5]
    assert g.finish_reason == "stop" and g.action_span == 15
    (o,) = outcomes
    assert o == EpisodeOutcome(label="7", reward=0.25 + 0.5 + 0.75, score=2.0, extra_logs={"turn": 2.0}, turns=3)
    # a distinct seed stream per turn, derived from the prompt's request seed and the sample
    assert [call[2][0] for call in engine.calls] == [turn_seed(1000, 0, t) for t in range(3)]


def test_rollout_action_mask_has_one_span_per_turn(tmp_path, tokenizer):
    engine, agent = ScriptedEngine(), _agent(tmp_path, THREE_TURNS)
    prompts = [[2, 19, 5], [2, 20]]
    gens, outcomes = _run(engine, agent, tokenizer, prompts, ["7", "3"], n=2)
    rollout = to_rollout(prompts, gens, 0, tokenizer, ["a", "b"], ["7", "3"])
    assert rollout.num_samples == 4 and len(outcomes) == 4
    for b, (p, g) in enumerate([(3, gens[0][0]), (3, gens[0][1]), (2, gens[1][0]), (2, gens[1][1])]):
        mask = rollout.action_mask_BT1[b]
        expected = torch.zeros_like(mask)
        for start in (0, 6, 12):  # target position t scores token t + 1
            expected[p - 1 + start:p - 1 + start + 3] = 1
        assert torch.equal(mask, expected)
        spans = torch.diff(torch.cat([torch.zeros(1), mask, torch.zeros(1)])).abs().sum() / 2
        assert spans == 3
        assert torch.equal(rollout.sequences_BT[b, p:p + 15], torch.tensor(g.token_ids))
        lp = rollout.rollout_logprobs_BT1[b]
        assert torch.equal(lp[mask == 0], torch.zeros(int((mask == 0).sum())))
        assert torch.allclose(lp[mask == 1], torch.tensor([-0.5, -1.5, -2.5] * 3))
    assert rollout.response_lens_B.tolist() == [15, 15, 15, 15]
    assert "copy 7 :" in rollout.responses[0]
    # the two samples of a prompt are different episodes
    assert gens[0][0].token_ids != gens[0][1].token_ids


def test_turn_and_length_limits(tmp_path, tokenizer):
    forever = """
        def step(observation, action, label, **kwargs):
            return {"rewards": 1.0, "done": False, "environment_feedback": " a b"}
    """
    agent = _agent(tmp_path, forever)
    (gens,), (o,) = _run(ScriptedEngine(), agent, tokenizer, [[2, 19]], [None], max_turns=2)
    assert o.turns == 2 and o.reward == 2.0 and gens[0].finish_reason == "length"
    assert gens[0].action_mask == [1, 1, 1, 0, 0] * 2
    # length: prompt (2) + response <= 10; the last turn gets the budget left; the feedback is cut
    engine = ScriptedEngine()
    (gens,), (o,) = _run(engine, agent, tokenizer, [[2, 19]], [None], max_total=10)
    assert [call[1] for call in engine.calls] == [8, 3]
    assert o.turns == 2 and gens[0].action_mask == [1, 1, 1, 0, 0, 1, 1, 1]
    # per-turn cap
    engine = ScriptedEngine()
    _run(engine, agent, tokenizer, [[2, 19]], [None], max_total=12, turn_max_tokens=2)
    assert [call[1] for call in engine.calls] == [2, 2, 2]


def test_episodes_do_not_depend_on_the_other_prompts(tmp_path, tokenizer):
    agent = _agent(tmp_path, THREE_TURNS)
    together, _ = _run(ScriptedEngine(), agent, tokenizer, [[2, 19], [2, 20, 21]], ["1", "2"], n=2, seeds=[5, 6])
    alone, _ = _run(ScriptedEngine(), agent, tokenizer, [[2, 20, 21]], ["2"], n=2, seeds=[6])
    assert [g.token_ids for g in together[1]] == [g.token_ids for g in alone[0]]


@pytest.mark.parametrize("init", ["def", "async def"])  # OpenRLHF's own example has `async def __init__`
def test_openrlhf_agent_instance_file_loads_and_runs(tmp_path, tokenizer, init):
    body = """
        import torch
        from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor

        class AgentInstance(AgentInstanceBase):
            INIT __init__(self, *args, **kwargs):
                self.step_idx = 0

            async def reset(self, states: dict, **kwargs):
                return {"observation": states["observation"]}

            async def step(self, states: dict, **kwargs):
                done = self.step_idx >= 1
                self.step_idx += 1
                assert states["label"] == "4" and states["observation_text"].startswith("p")
                return {"rewards": torch.tensor([1.0 if done else 0.5]), "scores": torch.tensor(0.0),
                        "environment_feedback": "" if done else " copy 4 :", "done": done,
                        "sampling_params": states.get("sampling_params"), "extra_logs": {"x": torch.tensor(2.0)}}

        class AgentExecutor(MultiTurnAgentExecutor):
            def __init__(self):
                super().__init__(AgentInstance)
    """
    agent = _agent(tmp_path, body.replace("INIT", init))
    (gens,), outcomes = _run(ScriptedEngine(), agent, tokenizer, [[2, 19]], ["4"], n=2)
    assert [o.turns for o in outcomes] == [2, 2] and [o.reward for o in outcomes] == [1.5, 1.5]
    assert outcomes[0].extra_logs == {"x": 2.0} and gens[0].action_mask == [1, 1, 1, 0, 0, 0, 1, 1, 1]


def test_agent_file_errors(tmp_path):
    with pytest.raises(ValueError, match="neither step"):
        _agent(tmp_path, "x = 1\n")
    with pytest.raises(ValueError, match="implements execute"):
        _agent(tmp_path, """
            from openrlhf.utils.agent import AgentExecutorBase
            class AgentExecutor(AgentExecutorBase):
                async def execute(self, *args):
                    pass
        """, "custom.py")
    with pytest.raises(ValueError, match="no 'done'"):
        parse_step({"rewards": 1.0}, "o", "a", "here")
    with pytest.raises(ValueError, match="must extend"):
        parse_step({"rewards": 1.0, "done": False, "next_observation": "other"}, "o", "a", "here")
    assert parse_step({"rewards": 1, "done": 0, "next_observation": "oa more"}, "o", "a", "here").feedback == " more"


def test_agent_rewards_read_the_episode_outcomes():
    outcomes = [EpisodeOutcome("1", 1.5, 1.0, {"k": 3.0}, 2), EpisodeOutcome("2", 0.0, 0.0, {"k": 1.0}, 1)]
    result = AgentRewards().score(RewardInputs(["q"] * 2, ["p"] * 2, outcomes, torch.zeros(2, 3), torch.ones(2, 3)))
    assert result.rewards_B.tolist() == [1.5, 0.0] and result.scores_B.tolist() == [1.0, 0.0]
    assert result.extra_logs["k"].tolist() == [3.0, 1.0] and result.extra_logs["agent_turns"].tolist() == [2.0, 1.0]


def test_returns_and_gae_skip_environment_tokens():
    """With the environment's tokens removed, a multi-span row's returns and advantages are those of one
    contiguous response (the episode reward on the last action token reaches every turn)."""
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 0, 1, 1, 0]], dtype=torch.float32)
    kl = torch.randn(1, 10)
    rewards = token_rewards(torch.tensor([2.0]), mask, kl, 0.1)
    values = torch.randn(1, 10)
    keep = mask[0] > 0
    dense_mask = torch.ones(1, int(keep.sum()))
    for gamma in (1.0, 0.9):
        ret = discounted_returns(rewards, mask, gamma)
        assert torch.allclose(ret[:, keep], discounted_returns(rewards[:, keep], dense_mask, gamma))
        assert torch.equal(ret[:, ~keep], torch.zeros(1, int((~keep).sum())))
        adv, rets = gae(rewards, values, mask, gamma, 0.95)
        dense_adv, dense_rets = gae(rewards[:, keep], values[:, keep], dense_mask, gamma, 0.95)
        assert torch.allclose(adv[:, keep], dense_adv) and torch.allclose(rets[:, keep], dense_rets)
    assert float(discounted_returns(rewards, mask, 1.0)[0, 1]) == pytest.approx(float(rewards[0, keep].sum()))


@pytest.mark.parametrize("name", ["gae", "reinforce", "reinforce_baseline", "rloo", "group_norm", "dr_grpo"])
def test_every_estimator_credits_every_turn(name):
    """The advantage of each action token of a multi-span row equals that of the same row without the
    environment's tokens (every turn gets the episode's credit; environment tokens get none)."""
    from rlhf.algorithms.advantages import ESTIMATORS

    est = ESTIMATORS[name]
    torch.manual_seed(0)
    mask = torch.zeros(4, 12)
    for row, spans in enumerate([[(1, 3), (6, 8)], [(1, 4)], [(2, 3), (5, 6), (9, 11)], [(1, 2), (4, 9)]]):
        for a, b in spans:
            mask[row, a:b] = 1
    scores = torch.tensor([1.0, 0.0, 0.5, 2.0])
    if est.group_step is not None:
        scores = est.group_step(scores.reshape(2, 2)).reshape(-1)
    gamma = 1.0 if est.gamma_one else 0.9
    values = torch.randn(4, 12)
    for row in range(4):
        m, keep = mask[row:row + 1], mask[row] > 0
        dense = torch.ones(1, int(keep.sum()))
        r, r_dense = token_rewards(scores[row:row + 1], m), token_rewards(scores[row:row + 1], dense)
        if est.needs_critic:
            adv = gae(r, values[row:row + 1], m, gamma, 0.95)[0]
            adv_dense = gae(r_dense, values[row:row + 1, keep], dense, gamma, 0.95)[0]
        else:
            adv, adv_dense = discounted_returns(r, m, gamma), discounted_returns(r_dense, dense, gamma)
        assert torch.allclose(adv[0, keep], adv_dense[0]) and not adv[0, ~keep].any()


def test_agent_flags_parse_and_conflicts():
    from rlhf.config.flags import parse_config
    from rlhf.config.ppo_config import TrainPPOConfig

    assert "agent_func_path" not in TrainPPOConfig.PENDING_FLAGS
    cfg = parse_config(TrainPPOConfig, ["--agent_func_path", "a.py", "--agent_max_turns", "3"])
    assert cfg.agent.agent_func_path == "a.py" and cfg.agent.agent_max_turns == 3
    assert cfg.with_demo_defaults().reward.remote_rm_url is None  # no demo reward: the agent's rewards
    with pytest.raises((ValueError, SystemExit)):
        parse_config(TrainPPOConfig, ["--agent_func_path", "a.py", "--remote_rm_url", "r.py"])
