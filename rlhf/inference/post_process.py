"""The post-processors of the generation pipelines, applied to scored rows ({"input", "output", "reward"}),
as OpenRLHF v0.9.5's `--post_processor` defines them. Pure functions over lists of rows (never mutated);
rows of one prompt are grouped by their exact "input" text, and prompts keep the order of their first row.

- `rs` (rejection sampling, Llama 2): one row per prompt, its highest-rewarded output (the first on ties):
  {"input", "output", "reward"}, what `train_sft --input_key input --output_key output` reads.
- `iter_dpo` (iterative DPO, RLHFlow): one pair per prompt, its highest- and lowest-rewarded outputs (the first
  of each on ties): {"prompt", "chosen", "chosen_reward", "rejected", "rejected_reward"}, what `train_dpo
  --prompt_key prompt --chosen_key chosen --rejected_key rejected` reads. A prompt whose outputs all score the
  same gets chosen == rejected, as in OpenRLHF.
- `csft` (conditional SFT, SteerLM-style): every row, its input rewritten by the reward template with the
  reward to two decimals (default "{input} <rm_score>: {reward} "); with `normalize_reward` the rewards are
  first standardised over all rows (mean 0, unbiased std 1), and the row keeps the standardised reward.
"""

from __future__ import annotations

import math
from collections.abc import Callable

DEFAULT_REWARD_TEMPLATE = "{input} <rm_score>: {reward} "


def reward_stats(rows: list[dict]) -> tuple[float, float]:
    """(mean, unbiased std) of the rows' rewards (std nan for fewer than two rows)."""
    rewards = [float(r["reward"]) for r in rows]
    mean = sum(rewards) / len(rewards)
    if len(rewards) < 2:
        return mean, math.nan
    return mean, math.sqrt(sum((x - mean) ** 2 for x in rewards) / (len(rewards) - 1))


def standardize_rewards(rows: list[dict]) -> list[dict]:
    """The rows with each reward replaced by (reward - mean) / std over all rows (float64 statistics); a
    ValueError when the rewards have no spread (fewer than two rows, or all equal)."""
    mean, std = reward_stats(rows)
    if not std > 0:
        raise ValueError(f"--normalize_reward: the {len(rows)} rewards have no spread (std {std}); drop "
                         "--normalize_reward or score more rows")
    return [{**row, "reward": (float(row["reward"]) - mean) / std} for row in rows]


def conditional_sft(rows: list[dict], reward_template: str | None = None, normalize_reward: bool = False) -> list[dict]:
    """Every row with its input written into `reward_template` ({reward} first, then {input}, as OpenRLHF)."""
    template = reward_template or DEFAULT_REWARD_TEMPLATE
    if normalize_reward:
        rows = standardize_rewards(rows)
    return [{**row, "input": template.replace("{reward}", f"{float(row['reward']):.2f}").replace("{input}",
                                                                                               row["input"])}
            for row in rows]


def rejection_sampling(rows: list[dict]) -> list[dict]:
    """The best-rewarded output of each prompt."""
    best: dict[str, dict] = {}
    for row in rows:
        reward = float(row["reward"])
        if row["input"] not in best or reward > best[row["input"]]["reward"]:
            best[row["input"]] = {"input": row["input"], "output": row["output"], "reward": reward}
    return list(best.values())


def iterative_dpo(rows: list[dict]) -> list[dict]:
    """A (best, worst) output pair of each prompt."""
    pairs: dict[str, dict] = {}
    for row in rows:
        reward, output = float(row["reward"]), row["output"]
        pair = pairs.get(row["input"])
        if pair is None:
            pairs[row["input"]] = {"prompt": row["input"], "chosen": output, "chosen_reward": reward,
                                   "rejected": output, "rejected_reward": reward}
        elif reward > pair["chosen_reward"]:
            pair.update(chosen=output, chosen_reward=reward)
        elif reward < pair["rejected_reward"]:
            pair.update(rejected=output, rejected_reward=reward)
    return list(pairs.values())


PROCESSORS: dict[str, Callable[[list[dict], str | None, bool], list[dict]]] = {
    "rs": lambda rows, reward_template, normalize_reward: rejection_sampling(rows),
    "csft": conditional_sft,
    "iter_dpo": lambda rows, reward_template, normalize_reward: iterative_dpo(rows),
}
"""--post_processor name -> fn(rows, reward_template, normalize_reward)."""


def post_process(name: str, rows: list[dict], reward_template: str | None = None,
                 normalize_reward: bool = False) -> list[dict]:
    """The rows post-processed by `PROCESSORS[name]`."""
    return PROCESSORS[name](rows, reward_template, normalize_reward)
