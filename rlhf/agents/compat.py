"""The names an OpenRLHF v0.9.5 agent file imports from `openrlhf.utils.agent`, so such files load
unchanged (`rlhf.agents.interface` maps the module here when OpenRLHF is not installed). Only the
per-episode `AgentInstance` is used: our rollout loop plays the executor's part."""

from __future__ import annotations


class AgentInstanceBase:
    """One environment per episode: `async reset(states)` (optional) and `async step(states)`."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    async def reset(self, states: dict, **kwargs):
        return states


class AgentExecutorBase:
    """Custom executors (their own `execute`) are refused by `load_agent`."""


class MultiTurnAgentExecutor(AgentExecutorBase):
    def __init__(self, agent_instance_cls) -> None:
        self.agent_instance_cls = agent_instance_cls
