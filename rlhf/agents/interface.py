"""Loading a user's agent file (`--agent_func_path agent.py`) and calling its environment step.

Two forms are accepted (both OpenRLHF's):
- a module-level function `step(observation, action, label, **kwargs)`, sync or async (OpenRLHF's
  function interface). `observation` is the episode's text so far (the prompt, then every turn's action
  and environment text), `action` the text the model just generated (special tokens kept), `label` the
  dataset's label (--label_key); keyword arguments: `turn` (0-based model turn).
- an `AgentInstance` class (OpenRLHF v0.9.5's `AgentInstanceBase`), or an `AgentExecutor` built on
  `MultiTurnAgentExecutor(AgentInstance)`: one instance per episode, `await reset(states)` once and
  `await step(states)` per turn with states = {"observation_text", "action_text", "label",
  "sampling_params": None}. `from openrlhf.utils.agent import ...` resolves to `rlhf.agents.compat`
  when OpenRLHF is not installed. A custom `AgentExecutorBase.execute()` (it drives a Ray vLLM engine
  itself) has no equivalent here and is refused.

The step returns a dict: "rewards" (number or one-element tensor, required), "done" (bool, required),
"environment_feedback" (text appended after the action; "" or absent: nothing), or instead
"next_observation" (the whole next observation, which must start with observation + action: only the
rest is appended), optionally "scores" (dynamic filtering's 0-1 score) and "extra_logs" ({name: number},
the same names at every step). Other keys (e.g. "sampling_params") are ignored.
This module knows nothing about engines or tokens.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class StepResult:
    """One environment step, validated. feedback: the text appended to the episode after the action."""

    reward: float
    done: bool
    feedback: str
    score: float | None = None
    extra_logs: dict[str, float] = field(default_factory=dict)


def _number(value: Any, what: str, where: str) -> float:
    try:
        if hasattr(value, "item"):
            value = value.reshape(-1)[0].item() if value.numel() == 1 else value.item()
        return float(value)
    except (TypeError, ValueError, RuntimeError) as err:
        raise ValueError(f"{where}: {what} must be a number or a one-element tensor (got {value!r})") from err


def parse_step(out: Any, observation: str, action: str, where: str) -> StepResult:
    """Validate what an agent's step returned (see the module docstring)."""
    if not isinstance(out, dict):
        raise ValueError(f"{where}: step must return a dict with 'rewards', 'done' and 'environment_feedback' "
                         f"(got {type(out).__name__})")
    for key in ("rewards", "done"):
        if key not in out:
            raise ValueError(f"{where}: step returned no {key!r} (keys: {sorted(out)})")
    if "next_observation" in out and "environment_feedback" not in out:
        nxt, head = str(out["next_observation"]), observation + action
        if not nxt.startswith(head):
            raise ValueError(f"{where}: 'next_observation' must extend the observation and the action it was given "
                             "(the history is never re-tokenised); return 'environment_feedback' with only the new "
                             "text")
        feedback = nxt[len(head):]
    else:
        feedback = str(out.get("environment_feedback") or "")
    score = out.get("scores")
    extra = {k: _number(v, f"extra_logs[{k!r}]", where) for k, v in (out.get("extra_logs") or {}).items()}
    return StepResult(reward=_number(out["rewards"], "'rewards'", where), done=bool(out["done"]), feedback=feedback,
                      score=None if score is None else _number(score, "'scores'", where), extra_logs=extra)


class Agent:
    """A loaded agent file. `episode()` returns a fresh per-episode environment whose `reset` and `step`
    may return awaitables (the caller awaits them)."""

    def __init__(self, path: str, step_func=None, instance_cls=None) -> None:
        self.path, self.step_func, self.instance_cls = path, step_func, instance_cls

    def episode(self) -> _Episode:
        return _Episode(self)


class _Episode:
    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.instance = _instantiate(agent.instance_cls) if agent.instance_cls is not None else None

    def reset(self, observation: str, label: Any):
        """The instance's reset (None for the function form); its observation must be the prompt."""
        if self.instance is None or not hasattr(self.instance, "reset"):
            return None
        return self.instance.reset({"observation": observation, "label": label})

    def step(self, observation: str, action: str, label: Any, turn: int):
        if self.instance is None:
            return self.agent.step_func(observation, action, label, turn=turn)
        return self.instance.step({"observation_text": observation, "action_text": action, "label": label,
                                   "sampling_params": None})


def _instantiate(cls: type):
    """`cls()`, awaiting its `__init__` where that is `async def` (as in OpenRLHF's own agent example, which a
    plain call would reject: __init__ must return None)."""
    if not inspect.iscoroutinefunction(cls.__init__):
        return cls()
    instance = cls.__new__(cls)
    asyncio.run(instance.__init__())
    return instance


def load_agent(path: str) -> Agent:
    """Import `path` and find its step (see the module docstring); ValueError names what is wrong."""
    if not path.endswith(".py") or not os.path.isfile(path):
        raise ValueError(f"--agent_func_path {path}: not a Python file (expected a .py file defining step or "
                         "AgentInstance / AgentExecutor)")
    _install_openrlhf_shim()
    spec = importlib.util.spec_from_file_location("rlhf_user_agent", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    instance_cls = getattr(module, "AgentInstance", None)
    executor_cls = getattr(module, "AgentExecutor", None)
    if instance_cls is None and executor_cls is not None:
        instance_cls = getattr(executor_cls(), "agent_instance_cls", None)
        if instance_cls is None:
            raise ValueError(f"--agent_func_path {path}: its AgentExecutor implements execute() itself; only "
                             "MultiTurnAgentExecutor(AgentInstance) executors and step functions are supported here")
    if instance_cls is not None:
        if not inspect.isclass(instance_cls) or not callable(getattr(instance_cls, "step", None)):
            raise ValueError(f"--agent_func_path {path}: AgentInstance must be a class with a step(states) method")
        return Agent(path, instance_cls=instance_cls)
    step = getattr(module, "step", None)
    if not callable(step):
        raise ValueError(f"--agent_func_path {path} defines neither step(observation, action, label, **kwargs) nor "
                         "an AgentInstance class")
    return Agent(path, step_func=step)


def _install_openrlhf_shim() -> None:
    """Let OpenRLHF agent files import `openrlhf.utils.agent` when OpenRLHF itself is not installed."""
    if "openrlhf.utils.agent" in sys.modules or importlib.util.find_spec("openrlhf") is not None:
        return
    import types

    from rlhf.agents import compat

    for name in ("openrlhf", "openrlhf.utils"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["openrlhf.utils.agent"] = compat
