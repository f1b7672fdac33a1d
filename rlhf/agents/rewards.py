"""The reward source of agent runs: each sample's episode reward, as its agent returned it (carried in
`Rollout.labels` as an `EpisodeOutcome`). No model, no I/O."""

from __future__ import annotations

import torch

from rlhf.data.records import EpisodeOutcome
from rlhf.rewards.base import RewardInputs, RewardResult


class AgentRewards:
    """A `RewardSource`: rewards = the episode rewards (sum over turns), scores = the last turn's scores;
    extra logs = the last turn's `extra_logs` and `agent_turns` (model turns per episode)."""

    collective = False

    def score(self, batch: RewardInputs) -> RewardResult:
        outcomes = batch.labels
        if not all(isinstance(o, EpisodeOutcome) for o in outcomes):
            raise TypeError("AgentRewards scores agent episodes only (labels must be EpisodeOutcome records)")
        names = sorted({k for o in outcomes for k in o.extra_logs})
        missing = [k for k in names if any(k not in o.extra_logs for o in outcomes)]
        if missing:
            raise ValueError(f"the agent's extra_logs {missing} are missing at some steps: return the same names "
                             "at every step")
        extra = {k: torch.tensor([o.extra_logs[k] for o in outcomes], dtype=torch.float32) for k in names}
        extra["agent_turns"] = torch.tensor([float(o.turns) for o in outcomes])
        return RewardResult(rewards_B=torch.tensor([o.reward for o in outcomes], dtype=torch.float32),
                            scores_B=torch.tensor([o.score for o in outcomes], dtype=torch.float32),
                            extra_logs=extra)
