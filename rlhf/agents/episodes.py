"""The multi-turn episode loop: every (prompt, sample) pair is one episode that alternates a model turn
(one engine call for all the episodes still running) with the agent's step.

Token-in-token-out: the engine's token ids are kept as generated, and only the environment's new text
is tokenised (without special tokens) and appended; the history is never re-tokenised. The model's
tokens are the actions (mask 1, the engine's log-probs); the environment's are context (mask 0,
log-prob 0). Each turn of each sample draws its own seed stream (`turn_seed`), so an episode depends
only on its prompt's request seed, never on the engine count or the other episodes.

Limits (OpenRLHF's): an episode's prompt and response together hold at most `max_total` tokens
(--prompt_max_len + --generate_max_len); each turn may generate up to the budget left. Ours besides:
`max_turns` model turns at most and `turn_max_tokens` per turn (0: no such limit).
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
from dataclasses import dataclass, field
from typing import Any

from rlhf.agents.interface import Agent, parse_step
from rlhf.data.records import EpisodeOutcome
from rlhf.engines.rollout import MAX_REQUEST_SEED, Generation, RolloutEngine, SamplingSpec


@dataclass(frozen=True)
class TurnLimits:
    max_total: int  # prompt + response tokens of an episode
    max_turns: int = 0  # 0: until the agent says done or the length runs out
    turn_max_tokens: int = 0  # 0: the whole budget left


def turn_seed(request_seed: int, sample: int, turn: int) -> int:
    """The seed of one turn of one sample of a prompt whose request seed is `request_seed`."""
    digest = hashlib.blake2b(f"agent:{request_seed}:{sample}:{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & MAX_REQUEST_SEED


@dataclass
class _Episode:
    prompt_ids: list[int]
    observation: str
    label: Any
    seed: int
    sample: int
    env: Any
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    reward: float = 0.0
    score: float | None = None
    extra: dict[str, float] = field(default_factory=dict)
    turns: int = 0
    done: bool = False

    def budget(self, limits: TurnLimits) -> int:
        left = limits.max_total - len(self.prompt_ids) - len(self.tokens)
        if limits.max_turns and self.turns >= limits.max_turns:
            return 0
        return min(left, limits.turn_max_tokens) if limits.turn_max_tokens else left


def _resolve(values: list) -> list:
    """Await the awaitables among `values` (concurrently, as OpenRLHF runs its agents)."""
    pending = [i for i, v in enumerate(values) if inspect.isawaitable(v)]
    if pending:
        async def gather():
            return await asyncio.gather(*(values[i] for i in pending))

        for i, v in zip(pending, asyncio.run(gather())):
            values[i] = v
    return values


def _start(agent: Agent, prompt_ids: list[list[int]], texts: list[str], labels: list, seeds: list[int],
           n: int) -> list[_Episode]:
    episodes = [_Episode(list(ids), text, label, seed, k, agent.episode())
                for ids, text, label, seed in zip(prompt_ids, texts, labels, seeds) for k in range(n)]
    for e, reset in zip(episodes, _resolve([e.env.reset(e.observation, e.label) for e in episodes])):
        if isinstance(reset, dict) and reset.get("observation", e.observation) != e.observation:
            raise ValueError(f"--agent_func_path {agent.path}: reset() changed the observation; the prompt is "
                             "tokenised by the dataset pipeline here, so reset must return it unchanged")
    return episodes


def _model_turn(engine: RolloutEngine, episodes: list[_Episode], spec: SamplingSpec, limits: TurnLimits
                ) -> list[tuple[_Episode, Generation]]:
    """One turn for every episode with budget left, one engine call per distinct budget."""
    by_budget: dict[int, list[_Episode]] = {}
    for e in episodes:
        if not e.done and e.budget(limits) > 0:
            by_budget.setdefault(e.budget(limits), []).append(e)
    played = []
    for budget, group in sorted(by_budget.items()):
        turn_spec = SamplingSpec(n=1, temperature=spec.temperature, top_p=spec.top_p, max_tokens=budget,
                                 repetition_penalty=spec.repetition_penalty)
        outs = engine.generate([e.prompt_ids + e.tokens for e in group], turn_spec,
                               [turn_seed(e.seed, e.sample, e.turns) for e in group])
        played.extend((e, out[0]) for e, out in zip(group, outs))
    return played


def run_episodes(engine: RolloutEngine, agent: Agent, tokenizer, prompt_ids: list[list[int]], texts: list[str],
                 labels: list, spec: SamplingSpec, seeds: list[int], limits: TurnLimits
                 ) -> tuple[list[list[Generation]], list[EpisodeOutcome]]:
    """`spec.n` episodes per prompt (`seeds[i]`: prompt i's request seed). Returns, per prompt, its episodes'
    responses (model and environment tokens, `action_mask` set) and one outcome per episode, in order.
    Ranks of one engine call it with identical arguments (the agent must then be deterministic)."""
    episodes = _start(agent, prompt_ids, texts, labels, seeds, spec.n)
    while True:
        played = _model_turn(engine, episodes, spec, limits)
        if not played:
            break
        actions = [tokenizer.decode(g.token_ids, skip_special_tokens=False) for _, g in played]
        results = _resolve([e.env.step(e.observation, a, e.label, e.turns) for (e, _), a in zip(played, actions)])
        for (e, g), action, out in zip(played, actions, results):
            step = parse_step(out, e.observation, action, f"--agent_func_path {agent.path}")
            feedback = tokenizer(step.feedback, add_special_tokens=False)["input_ids"] if step.feedback else []
            e.tokens += list(g.token_ids) + list(feedback)
            e.logprobs += list(g.logprobs) + [0.0] * len(feedback)
            e.mask += [1] * len(g.token_ids) + [0] * len(feedback)
            e.observation += action + step.feedback
            e.reward += step.reward
            e.score, e.extra, e.done = step.score, step.extra_logs, step.done
            e.turns += 1
    return _collect(episodes, limits, spec.n)


def _collect(episodes: list[_Episode], limits: TurnLimits, n: int
             ) -> tuple[list[list[Generation]], list[EpisodeOutcome]]:
    gens, outcomes = [], []
    for e in episodes:
        keep = limits.max_total - len(e.prompt_ids)  # the environment's last text may overflow: cut (OpenRLHF)
        gens.append(Generation(e.tokens[:keep], e.logprobs[:keep], "stop" if e.done else "length", e.mask[:keep]))
        outcomes.append(EpisodeOutcome(label=e.label, reward=e.reward, score=e.reward if e.score is None else e.score,
                                       extra_logs=e.extra, turns=e.turns))
    return [gens[i:i + n] for i in range(0, len(gens), n)], outcomes
