"""Scoring rows with a reward model (--eval_task rm): the rows' prompt + response texts made and tokenized as
OpenRLHF's SFTDataset makes them (template or chat template, `" " + EOS` appended, cut to --max_len with
the last token forced to EOS), the scalar-head model loaded as OpenRLHF's batch_inference loads it, and one
chunk of rows scored over the ranks. A row is {"input": prompt, "output": response, "reward": float}.

As in OpenRLHF's batch_inference, the reward model always applies the mean/std that reward-model training
stored in its config (reward - mean) / std when it has them (OpenRLHF builds it with normalize_reward=True),
and the head name stored in its config (`value_head_prefix`) wins over the flag. Knows nothing of files or
of the chunk loop.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlhf.config.inference_config import BatchInferenceConfig
from rlhf.data.formatting import make_chat_template, prompt_text, response_text
from rlhf.data.sources import Row, read_rows
from rlhf.data.supervised_samples import SFTBatch, SFTSample, column, load_sft_samples
from rlhf.inference.output import gather_to_first, split_range
from rlhf.models.micro_batches import MicroBatcher
from rlhf.models.value import load_scalar_head_model, stored_reward_norm
from rlhf.rewards.base import RewardInputs
from rlhf.rewards.models import RewardModelEnsemble


@dataclass(frozen=True)
class ScoringSample:
    """One row to score: its prompt and response texts, and the tokenized prompt + response + EOS."""

    prompt: str
    response: str
    sample: SFTSample


def load_scoring_samples(cfg: BatchInferenceConfig, tokenizer) -> list[ScoringSample]:
    """Every usable row of --dataset (rows OpenRLHF's SFTDataset drops, e.g. an empty response or a prompt of
    --max_len - 2 tokens or more, are dropped with a warning), in dataset order."""
    d = cfg.data
    rows = read_rows(d.dataset, probs=d.dataset_probs, split=d.dataset_split, max_samples=d.max_samples,
                     seed=cfg.seed, flag="--dataset")
    samples, _ = load_sft_samples(rows, tokenizer, input_key=d.input_key, output_key=d.output_key,
                                  input_template=d.input_template, apply_chat_template=d.apply_chat_template,
                                  multiturn=False, pretrain_mode=False, max_len=d.max_len,
                                  tokenizer_chat_template=d.tokenizer_chat_template)
    chat = make_chat_template(tokenizer, d.apply_chat_template, d.tokenizer_chat_template)
    # The loader keeps rows in order and drops some; a row repeated by --dataset_probs mixing is kept or
    # dropped every time, so walking both lists in step pairs each sample with its row.
    kept = iter(samples)
    sample = next(kept, None)
    out = []
    for row in rows:
        if sample is not None and sample.where == row.where:
            out.append(ScoringSample(*_texts(row, cfg, chat), sample))
            sample = next(kept, None)
    assert sample is None, "every sample pairs with one row"
    return out


def _texts(row: Row, cfg: BatchInferenceConfig, chat) -> tuple[str, str]:
    d = cfg.data
    value = column(row, d.input_key, "--input_key")
    prompt = prompt_text(value, input_template=d.input_template, chat=chat, where=row.where, key=d.input_key,
                         flag="--input_key")
    response = response_text(value, prompt, column(row, d.output_key, "--output_key"), chat=chat, where=row.where,
                             key=d.output_key, flag="--output_key")
    return prompt, response


def head_prefix(path: str, flag_value: str) -> str:
    """The scalar head's name: the `value_head_prefix` stored in the model's config when there is one (OpenRLHF
    prefers it), else --value_head_prefix."""
    with open(os.path.join(path, "config.json")) as f:
        stored = json.load(f).get("value_head_prefix")
    return stored if isinstance(stored, str) and stored else flag_value


def build_scorer(cfg: BatchInferenceConfig, device: torch.device) -> RewardModelEnsemble:
    """The reward model of --pretrain on `device`, in --micro_batch_size forwards, normalised by its stored
    mean/std when it has them."""
    m = cfg.model
    model = load_scalar_head_model(m.pretrain, head_prefix(m.pretrain, m.value_head_prefix), m.dtype, m.attn,
                                   m.trust_remote_code, "--pretrain").to(device).eval()
    norm = stored_reward_norm(m.pretrain)
    return RewardModelEnsemble([model], device, MicroBatcher(cfg.scoring.micro_batch_size),
                               [norm] if norm is not None else None)


@dataclass
class ChunkScorer:
    """Scores chunks of `samples`, each rank its contiguous part (data-parallel replica `dp_rank` of `dp_size`)."""

    scorer: RewardModelEnsemble
    samples: list[ScoringSample]
    pad_id: int
    dp_size: int
    dp_rank: int
    group: dist.ProcessGroup

    def __call__(self, items: range) -> list[dict]:
        """The rows of samples `items`, in order, on global rank 0 ([] elsewhere). Collective: every rank of
        `group` (the world) calls it with the same `items`."""
        mine = [self.samples[i] for i in split_range(items, self.dp_size, self.dp_rank)]
        rows: list[dict] = []
        if mine:
            batch = SFTBatch.collate([s.sample for s in mine], self.pad_id)
            inputs = RewardInputs(queries=[s.prompt + s.response for s in mine], prompts=[s.prompt for s in mine],
                                  labels=[None] * len(mine), sequences_BT=batch.input_ids_BT,
                                  attention_mask_BT=batch.attention_mask_BT)
            rewards = self.scorer.score(inputs).rewards_B.tolist()
            rows = [{"input": s.prompt, "output": s.response, "reward": r} for s, r in zip(mine, rewards)]
        return gather_to_first(rows, self.group)
