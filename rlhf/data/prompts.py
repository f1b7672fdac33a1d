"""Prompt datasets for RL: read local data (as the supervised jobs' --dataset, mixed by --prompt_data_probs),
format, tokenize, filter.

Nothing here downloads. Formatting follows OpenRLHF: `--apply_chat_template` renders the prompt as a
user turn (or uses the row's message list as is) with a generation prompt; otherwise
`--input_template` wraps the raw text. Prompts longer than `--prompt_max_len` tokens are dropped
(never truncated: a cut prompt changes the task), and the count is reported.
"""

from __future__ import annotations

import random
import warnings
from dataclasses import dataclass
from typing import Any

from rlhf.config.ppo_config import DataConfig
from rlhf.data.sources import Row
from rlhf.data.sources import read_rows as read_dataset_rows


@dataclass(frozen=True)
class Prompt:
    """One formatted prompt: its text, token ids, label (None without --label_key) and data source (the row's
    `datasource` column, OpenRLHF's key for per-source evaluation metrics; "default" without one)."""

    text: str
    token_ids: tuple[int, ...]
    label: Any
    datasource: str = "default"


def read_rows(cfg: DataConfig, flag: str = "--prompt_data", seed: int = 42) -> list[Row]:
    """The rows of the prompt data (`flag` names it), read, mixed by --prompt_data_probs with `seed` (OpenRLHF
    blends prompt datasets with --seed) and capped at `max_samples` as the supervised jobs' --dataset is
    (`rlhf.data.sources.read_rows`)."""
    return read_dataset_rows(cfg.prompt_data, probs=cfg.prompt_data_probs, split=cfg.prompt_split,
                             max_samples=cfg.max_samples, seed=seed, flag=flag)


def _format(row: dict, where: str, cfg: DataConfig, tokenizer) -> str:
    if cfg.input_key not in row:
        columns = ", ".join(sorted(row)) if isinstance(row, dict) else type(row).__name__
        raise ValueError(f"{where}: no column {cfg.input_key!r} (columns: {columns}); "
                         "pass the right one with --input_key")
    value = row[cfg.input_key]
    if cfg.apply_chat_template:
        messages = value if isinstance(value, list) else [{"role": "user", "content": str(value)}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if not isinstance(value, str):
        raise ValueError(f"{where}: column {cfg.input_key!r} holds {type(value).__name__}, not text; "
                         "use --apply_chat_template for message lists")
    return cfg.input_template.format(value) if cfg.input_template else value


def _empty_prompt_problem(text: str, ids: list[int], tokenizer) -> str | None:
    """Why a formatted prompt gives the engine nothing to continue from (None if it is fine)."""
    if not text.strip():
        return "the prompt is empty after formatting"
    if not ids:
        return f"the prompt {text[:40]!r} tokenizes to no tokens"
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    if all(i in special for i in ids):
        return f"the prompt {text[:40]!r} is only special tokens"
    return None


def load_prompts(cfg: DataConfig, tokenizer, flag: str = "--prompt_data", seed: int = 42) -> list[Prompt]:
    """Formatted, tokenized prompts of `cfg.prompt_data` (named `flag` in messages; mixed with `seed`, the run's
    --seed, see `read_rows`); rows over `prompt_max_len` tokens are dropped with a warning; rows that are empty
    after formatting, tokenize to nothing or only to special tokens are an error naming each one (file and
    row)."""
    if cfg.tokenizer_chat_template:
        tokenizer.chat_template = cfg.tokenizer_chat_template
    prompts, too_long, empty = [], 0, []
    rows = read_rows(cfg, flag, seed)
    for record in rows:
        row, where = record.data, record.where
        text = _format(row, where, cfg, tokenizer)
        label = None
        if cfg.label_key is not None:
            if cfg.label_key not in row:
                raise ValueError(f"{where}: no column {cfg.label_key!r} for --label_key "
                                 f"(columns: {', '.join(sorted(row))})")
            label = row[cfg.label_key]
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        problem = _empty_prompt_problem(text, ids, tokenizer)
        if problem:
            empty.append(f"{where}: {problem}")
            continue
        if len(ids) > cfg.prompt_max_len:
            too_long += 1
            continue
        prompts.append(Prompt(text, tuple(ids), label, str(row.get("datasource", "default"))))
    if empty:
        shown = "; ".join(empty[:5]) + (f"; ... ({len(empty)} rows in all)" if len(empty) > 5 else "")
        raise ValueError(f"{flag} {cfg.prompt_data}: {len(empty)} prompt(s) would generate from nothing: "
                         f"{shown}; fix or remove these rows (or check --input_key / --input_template)")
    if too_long:
        warnings.warn(f"{flag}: dropped {too_long} of {len(rows)} prompts longer than --prompt_max_len "
                      f"{cfg.prompt_max_len} tokens", stacklevel=2)
    if not prompts:
        raise ValueError(f"{flag} {cfg.prompt_data}: no usable prompts "
                         f"({len(rows)} rows read, {too_long} longer than --prompt_max_len)")
    return prompts


def single_prompt(cfg: DataConfig, text: str, tokenizer, flag: str = "--custom_prompt") -> Prompt:
    """One prompt given on the command line, formatted like a dataset row (input template / chat template)."""
    if cfg.tokenizer_chat_template:
        tokenizer.chat_template = cfg.tokenizer_chat_template
    formatted = _format({cfg.input_key: text}, flag, cfg, tokenizer)
    ids = tokenizer(formatted, add_special_tokens=False)["input_ids"]
    problem = _empty_prompt_problem(formatted, ids, tokenizer)
    if problem:
        raise ValueError(f"{flag} {text!r}: {problem}")
    return Prompt(formatted, tuple(ids), None)


def load_texts(source: str, key: str, max_samples: int) -> list[str]:
    """The `key` column of a local JSON/JSONL file or directory (pretraining texts for the ptx loss)."""
    cfg = DataConfig(prompt_data=source, input_key=key, max_samples=max_samples)
    texts = []
    for record in read_rows(cfg, "--pretrain_data"):
        if not isinstance(record.data.get(key), str):
            raise ValueError(f"{record.where}: no text column {key!r}; pass the right one with --input_key")
        texts.append(record.data[key])
    return texts


class PromptSampler:
    """Yields the same global batches of prompts on every rank: shuffled per episode with the seed,
    incomplete last batches dropped. Each rollout engine then takes its own slice."""

    def __init__(self, prompts: list[Prompt], batch_size: int, seed: int) -> None:
        if len(prompts) < batch_size:
            raise ValueError(f"only {len(prompts)} prompts but --rollout_batch_size is {batch_size}; "
                             "lower it or add prompts")
        self.prompts = prompts
        self.batch_size = batch_size
        self.seed = seed

    @property
    def steps_per_episode(self) -> int:
        return len(self.prompts) // self.batch_size

    def refill(self, step: int, round_: int, count: int) -> list[Prompt]:
        """`count` prompts drawn at random from the whole dataset for extra generation round `round_` (>= 1) of
        step `step` (dynamic filtering), the same on every rank and on resume."""
        rng = random.Random(f"refill:{self.seed}:{step}:{round_}")
        if count <= len(self.prompts):
            return [self.prompts[i] for i in rng.sample(range(len(self.prompts)), count)]
        return [self.prompts[rng.randrange(len(self.prompts))] for _ in range(count)]

    def batch_ids(self, step: int) -> list[int]:
        """Which prompts (their places in the prompt data) global batch `step` holds (0-based, counting across
        episodes): the same at any world size."""
        episode, index = divmod(step, self.steps_per_episode)
        order = list(range(len(self.prompts)))
        random.Random(self.seed * 1_000_003 + episode).shuffle(order)
        return order[index * self.batch_size:(index + 1) * self.batch_size]

    def batch(self, step: int) -> list[Prompt]:
        """Global batch number `step`'s prompts (`batch_ids`)."""
        return [self.prompts[i] for i in self.batch_ids(step)]
