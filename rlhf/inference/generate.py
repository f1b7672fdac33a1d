"""Batch generation: the dataset's prompts formatted, tokenized and indexed, the rollout engine of
`--eval_task` (in-process vLLM, or HF generate), and one chunk of prompts generated over the engines.

Each prompt samples from its own seed, derived from the run seed and the prompt's index in the dataset
(`request_seed`), and engines take contiguous slices of each chunk, so the rows do not depend on how many
engines share the work. A row is {"input": the formatted prompt, "output": the generated text}, as
OpenRLHF's batch_inference writes them; a prompt's `--best_of_n` rows are consecutive. This module knows
nothing of files or of the chunk loop.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlhf.config.errors import UsageError
from rlhf.config.inference_config import BatchInferenceConfig
from rlhf.data.formatting import check_input_template, make_chat_template, prompt_text
from rlhf.data.sources import Row, read_rows
from rlhf.data.supervised_samples import column
from rlhf.engines.rollout import Generation, RolloutEngine, SamplingSpec, request_seed
from rlhf.inference.output import gather_to_first, split_range


@dataclass(frozen=True)
class IndexedPrompt:
    """One formatted prompt: its row's index in the dataset (its seed derives from it), text and token ids."""

    index: int
    text: str
    token_ids: tuple[int, ...]


def iter_rows(num_rows: int, iteration: int | None, rollout_batch_size: int) -> range:
    """The rows one invocation generates for: all of them, or with `--iter` the slice [iter x
    rollout_batch_size, (iter + 1) x rollout_batch_size), cut at the end of the data (OpenRLHF's rule)."""
    if iteration is None:
        return range(num_rows)
    start = iteration * rollout_batch_size
    if start >= num_rows:
        raise UsageError(f"--iter {iteration} x --rollout_batch_size {rollout_batch_size} = row {start}, past the "
                         f"{num_rows} rows of --dataset: lower --iter or --rollout_batch_size")
    return range(start, min(start + rollout_batch_size, num_rows))


def load_generation_prompts(cfg: BatchInferenceConfig, tokenizer) -> list[IndexedPrompt]:
    """The prompts of this invocation in dataset order: formatted as OpenRLHF's PromptDataset does (chat template
    or --input_template), with --csft_prompt appended under --enable_csft, tokenized without special tokens.
    Prompts over --prompt_max_len tokens are dropped with a warning (never cut: a cut prompt changes the task);
    a prompt of no tokens is an error naming its row."""
    d, g = cfg.data, cfg.generation
    rows = read_rows(d.dataset, probs=d.dataset_probs, split=d.dataset_split, max_samples=d.max_samples,
                     seed=cfg.seed, flag="--dataset")
    chat = make_chat_template(tokenizer, d.apply_chat_template, d.tokenizer_chat_template)
    if chat is None:
        check_input_template(d.input_template)
    suffix = g.csft_prompt.strip() + " " if g.enable_csft else ""
    selected = iter_rows(len(rows), g.iter, g.rollout_batch_size)
    prompts = [_prompt(rows[i], i, suffix, cfg, chat, tokenizer) for i in selected]
    kept = [p for p in prompts if len(p.token_ids) <= g.prompt_max_len]
    if len(kept) < len(prompts):
        warnings.warn(f"dropped {len(prompts) - len(kept)} of {len(prompts)} prompts longer than --prompt_max_len "
                      f"{g.prompt_max_len} tokens", stacklevel=2)
    if not kept:
        raise UsageError(f"--dataset {d.dataset}: no prompt fits --prompt_max_len {g.prompt_max_len}; raise it")
    return kept


def _prompt(row: Row, index: int, suffix: str, cfg: BatchInferenceConfig, chat, tokenizer) -> IndexedPrompt:
    d = cfg.data
    text = prompt_text(column(row, d.input_key, "--input_key"), input_template=d.input_template, chat=chat,
                       where=row.where, key=d.input_key, flag="--input_key") + suffix
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError(f"{row.where}: the prompt {text[:40]!r} tokenizes to no tokens; fix or remove the row "
                         "(or check --input_key / --input_template)")
    return IndexedPrompt(index, text, tuple(ids))


def sampling_spec(cfg: BatchInferenceConfig) -> SamplingSpec:
    """--best_of_n samples of at most --max_new_tokens tokens; temperature 0 (vLLM: greedy) with
    --greedy_sampling."""
    g = cfg.generation
    return SamplingSpec(n=g.best_of_n, temperature=0.0 if g.greedy else g.temperature, top_p=g.top_p,
                        max_tokens=g.max_new_tokens, repetition_penalty=g.repetition_penalty)


def rollout_tp_size(cfg: BatchInferenceConfig, world_size: int) -> int:
    """Ranks per engine: 1 for HF generate; for vLLM --tp_size, by default the ranks of one node (torchrun's
    LOCAL_WORLD_SIZE; the whole world without it). It must divide the world."""
    if cfg.eval_task != "generate_vllm":
        return 1
    tp = cfg.vllm.tp_size or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if world_size % tp:
        raise UsageError(f"--tp_size {tp} does not divide the {world_size} ranks: every rank belongs to one engine of "
                         "--tp_size consecutive ranks")
    return tp


def check_engine_available(cfg: BatchInferenceConfig) -> None:
    """--eval_task generate_vllm needs vLLM installed (checked before any engine starts)."""
    from rlhf.engines.rollout import vllm_available

    if cfg.eval_task == "generate_vllm" and not vllm_available():
        raise UsageError("--eval_task generate_vllm needs vLLM: install the cpu or gpu extra, or use --eval_task "
                         "generate (HF transformers)")


def build_engine(cfg: BatchInferenceConfig, tp_size: int, device: torch.device, tokenizer,
                 sequences_per_call: int = 0) -> RolloutEngine:
    """This rank's engine: its share of an in-process vLLM engine (every rank must build one), or its own HF
    model. sequences_per_call: what one generate call samples (0: unknown; sizes the KV-cache check on CPU)."""
    m, v, g = cfg.model, cfg.vllm, cfg.generation
    if cfg.eval_task == "generate_vllm":
        from rlhf.engines.vllm_engine import VLLMEngine

        return VLLMEngine(m.pretrain, dtype=m.dtype, tp_size=tp_size, seed=cfg.seed,
                          max_model_len=g.prompt_max_len + g.max_new_tokens, kv_cache_bytes=v.vllm_kv_cache_bytes,
                          gpu_memory_utilization=v.vllm_gpu_memory_utilization, enforce_eager=v.enforce_eager,
                          enable_prefix_caching=v.enable_prefix_caching, enable_sleep=False,
                          trust_remote_code=m.trust_remote_code, max_num_seqs=v.max_num_seqs,
                          sequences_per_call=sequences_per_call)
    from rlhf.engines.hf_engine import HFGenerateEngine, stop_token_ids

    return HFGenerateEngine(m.pretrain, dtype=m.dtype, device=device,
                            eos_token_id=stop_token_ids(m.pretrain, tokenizer),
                            pad_token_id=tokenizer.pad_token_id, attn_implementation=m.attn,
                            trust_remote_code=m.trust_remote_code)


def generated_text(tokenizer, prompt_ids: Sequence[int], token_ids: Sequence[int], skip_special_tokens: bool) -> str:
    """The text the generated tokens add after the prompt: decoded in the prompt's context (so a leading space
    that belongs to the first generated token is kept), falling back to decoding the tokens alone where the
    tokenizer does not reproduce the prompt's text as a prefix."""
    head = tokenizer.decode(list(prompt_ids), skip_special_tokens=skip_special_tokens)
    full = tokenizer.decode(list(prompt_ids) + list(token_ids), skip_special_tokens=skip_special_tokens)
    if full.startswith(head):
        return full[len(head):]
    return tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)


@dataclass
class ChunkGenerator:
    """Generates chunks of `prompts` on this rank's engine (engine `engine_index` of `num_engines`; its
    first rank, `engine_lead`, reports the rows). `skip_special_tokens`: drop EOS and other special tokens
    from the text (OpenRLHF: HF generate does, vLLM does not)."""

    engine: RolloutEngine
    prompts: list[IndexedPrompt]
    spec: SamplingSpec
    seed: int
    tokenizer: object
    skip_special_tokens: bool
    num_engines: int
    engine_index: int
    engine_lead: bool
    group: dist.ProcessGroup

    def __call__(self, items: range) -> list[dict]:
        """The rows of prompts `items` (indices into `prompts`), in prompt order, on global rank 0 ([] on the
        others). Collective: every rank of `group` (the world) calls it with the same `items`."""
        mine = [self.prompts[i] for i in split_range(items, self.num_engines, self.engine_index)]
        rows: list[dict] = []
        if mine:  # the ranks of one engine hold the same slice, so they skip together
            seeds = [request_seed(self.seed, 0, p.index) for p in mine]
            generations = self.engine.generate([list(p.token_ids) for p in mine], self.spec, seeds)
            if self.engine_lead:
                rows = [row for p, gens in zip(mine, generations) for row in self._rows(p, gens)]
        return gather_to_first(rows, self.group)

    def _rows(self, prompt: IndexedPrompt, generations: list[Generation]) -> list[dict]:
        return [{"input": prompt.text,
                 "output": generated_text(self.tokenizer, prompt.token_ids, g.token_ids, self.skip_special_tokens)}
                for g in generations]
