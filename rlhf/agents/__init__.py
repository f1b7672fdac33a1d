"""Multi-turn agent rollouts (`--agent_func_path`): episodes that alternate model turns with an
environment's text, kept token-in-token-out, with the model's tokens as the only actions."""

from rlhf.agents.episodes import TurnLimits, run_episodes, turn_seed
from rlhf.agents.interface import Agent, StepResult, load_agent
from rlhf.agents.rewards import AgentRewards

__all__ = ["Agent", "AgentRewards", "StepResult", "TurnLimits", "load_agent", "run_episodes", "turn_seed"]
