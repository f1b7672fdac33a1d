"""Rollout engine on a private transformers copy of the policy, used when vLLM is not (or cannot be) installed.

Same interface as the vLLM engine, without tensor parallelism: every rank is its own engine. All prompts of a
`generate` call decode together: one left-padded prefill, the cache repeated for each prompt's n samples, then
one batched forward per new token, rows that stopped dropped from the batch as they accumulate. Token choice
(`token_sampling`) draws each prompt's samples from its own seeded stream. Log-probs are
log_softmax(logits / temperature) of the sampled tokens, as the actor computes them.

What a prompt's samples depend on: its tokens, its seed and the weights, not the other prompts of the batch.
The random draws are independent of the batch by construction; the logits are equal only up to float rounding,
since batched kernels (BLAS at another row count, attention over another amount of left padding) may round
differently in the last bits (measured: <= 2e-7 on the tiny fp32 policy). A token therefore changes with the
batch only if a draw falls within that rounding of a boundary of the cumulative distribution (or two logits
tie within it when greedy).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from rlhf.engines.rollout import Generation, SamplingSpec
from rlhf.engines.token_sampling import PromptStreams, next_tokens
from rlhf.models.loading import load_causal_lm
from rlhf.utils.preemption import cut_short

# Shapes: P prompts, R = P * n rows (a prompt's samples contiguous), B rows still decoding, L the longest prompt,
# S = L + max_tokens cache positions, T max_tokens, V the model's output vocabulary.

CPU_BATCH_KV_BYTES = 2 << 30  # default KV-cache budget of one decode batch on CPU
CUDA_FREE_FRACTION = 0.5  # default budget on CUDA: this share of the free device memory at the call
# generation_config fields whose logits processors `model.generate` applied and this engine does not
IGNORED_GENERATION_FIELDS = ("suppress_tokens", "begin_suppress_tokens", "bad_words_ids", "no_repeat_ngram_size",
                             "min_new_tokens", "min_length", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff",
                             "sequence_bias", "forced_bos_token_id", "forced_eos_token_id", "renormalize_logits")


@dataclass
class _Batch:
    """The rows still decoding: `rows_B` their index in the call's R rows, the model's cache for them, the
    attention mask of every position they can reach (`mask_BS`: `width` = L prompt columns, then T), prompt
    lengths, tokens seen (repetition penalty only)."""

    width: int
    rows_B: torch.Tensor
    cache: object
    mask_BS: torch.Tensor
    prompt_lens_B: torch.Tensor
    seen_BV: torch.Tensor | None

    def keep(self, keep_B: torch.Tensor) -> None:
        """Drop the rows where `keep_B` is False (from the cache too)."""
        index = keep_B.nonzero()[:, 0]
        self.cache.reorder_cache(index)
        self.rows_B, self.mask_BS = self.rows_B[index], self.mask_BS[index]
        self.prompt_lens_B = self.prompt_lens_B[index]
        self.seen_BV = None if self.seen_BV is None else self.seen_BV[index]


class HFGenerateEngine:
    """`RolloutEngine` backed by a private copy of the policy and a batched decode loop over its forward.

    `max_batch_kv_bytes` bounds the KV cache of one decode batch (rows x (longest prompt + max_tokens)); prompts
    beyond it decode in further batches, which changes no sample. None: 2 GiB on CPU, half the free memory at the
    call on CUDA. `eos_token_id`: the token, or tokens (`stop_token_ids`), that end a sample."""

    def __init__(self, model_path: str, *, dtype: torch.dtype, device: torch.device,
                 eos_token_id: int | Sequence[int],
                 pad_token_id: int, attn_implementation: str = "sdpa", trust_remote_code: bool = False,
                 max_batch_kv_bytes: int | None = None) -> None:
        if max_batch_kv_bytes is not None and max_batch_kv_bytes <= 0:
            raise ValueError(f"max_batch_kv_bytes must be positive, got {max_batch_kv_bytes}")
        self.model = load_causal_lm(model_path, dtype, attn_implementation, trust_remote_code).to(device).eval()
        self.device = device
        self.stop_token_ids = [eos_token_id] if isinstance(eos_token_id, int) else sorted(set(eos_token_id))
        self._stop_ids = torch.tensor(self.stop_token_ids, device=device)
        self.pad_token_id = pad_token_id
        self.max_batch_kv_bytes = max_batch_kv_bytes
        self._logits_to_keep = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        self._kv_bytes_per_token = kv_bytes_per_token(self.model.config, dtype)
        warn_ignored_generation_config(self.model, model_path)

    def generate(self, prompts: list[list[int]], spec: SamplingSpec, seeds: list[int]) -> list[list[Generation]]:
        assert len(seeds) == len(prompts), "one seed per prompt"
        gens: list[list[Generation]] = []
        for lo, hi in self._batches(prompts, spec):
            gens.extend(self._generate_batch(prompts[lo:hi], spec, seeds[lo:hi]))
        return gens

    def _batches(self, prompts: list[list[int]], spec: SamplingSpec) -> list[tuple[int, int]]:
        """Consecutive [lo, hi) ranges of prompts whose decode batch fits the KV budget (at least one prompt)."""
        budget = self.max_batch_kv_bytes
        if budget is None:
            free = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else 0
            budget = int(CUDA_FREE_FRACTION * free) if free else CPU_BATCH_KV_BYTES
        ranges, lo, longest = [], 0, 0
        for i, prompt in enumerate(prompts):
            longest = max(longest, len(prompt))
            if i > lo and (i + 1 - lo) * spec.n * (longest + spec.max_tokens) * self._kv_bytes_per_token > budget:
                ranges.append((lo, i))
                lo, longest = i, len(prompt)
        return ranges + [(lo, len(prompts))] if prompts else []

    @torch.no_grad()
    def _generate_batch(self, prompts: list[list[int]], spec: SamplingSpec, seeds: list[int]) -> list[list[Generation]]:
        num_rows, steps = len(prompts) * spec.n, spec.max_tokens
        if steps == 0:
            return [[Generation([], [], "length") for _ in range(spec.n)] for _ in prompts]
        batch, logits_BV = self._prefill(prompts, spec)
        streams = PromptStreams(seeds, spec.n, steps, self.device) if spec.temperature > 0 else None
        tokens_RT = torch.full((num_rows, steps), self.pad_token_id, dtype=torch.long, device=self.device)
        logprobs_RT = torch.zeros(num_rows, steps, dtype=torch.float32, device=self.device)
        stopped_R = torch.zeros(num_rows, dtype=torch.bool, device=self.device)
        for t in range(steps):
            uniforms_B = None if streams is None else streams.uniforms(t)[batch.rows_B]
            tokens_B, logprobs_B = next_tokens(logits_BV, temperature=spec.temperature, top_p=spec.top_p,
                                               repetition_penalty=spec.repetition_penalty, seen_BV=batch.seen_BV,
                                               uniforms_B=uniforms_B)
            tokens_RT[batch.rows_B, t], logprobs_RT[batch.rows_B, t] = tokens_B, logprobs_B
            stopped_R[batch.rows_B] |= torch.isin(tokens_B, self._stop_ids)
            live_B = ~stopped_R[batch.rows_B]
            num_live = int(live_B.sum())
            if t + 1 == steps or num_live == 0 or cut_short():  # cut short: SIGTERM, the step is abandoned
                break
            # a stopped row's later tokens are discarded; dropping it costs a copy of the cache, so wait for half
            if 2 * num_live <= len(live_B):
                batch.keep(live_B)
                tokens_B = tokens_B[live_B]
            logits_BV = self._decode_step(batch, tokens_B, t)
        return self._generations(tokens_RT[:, :t + 1].tolist(), logprobs_RT[:, :t + 1].tolist(), spec.n)

    def _prefill(self, prompts: list[list[int]], spec: SamplingSpec) -> tuple[_Batch, torch.Tensor]:
        """One left-padded forward over the prompts, its cache and last logits repeated for each prompt's n rows."""
        longest = max(len(p) for p in prompts)
        ids_PL = torch.full((len(prompts), longest), self.pad_token_id, dtype=torch.long)
        mask_PL = torch.zeros(len(prompts), longest, dtype=torch.long)
        for i, prompt in enumerate(prompts):
            ids_PL[i, longest - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            mask_PL[i, longest - len(prompt):] = 1
        ids_PL, mask_PL = ids_PL.to(self.device), mask_PL.to(self.device)
        extra = {"logits_to_keep": 1} if self._logits_to_keep else {}
        out = self.model(input_ids=ids_PL, attention_mask=mask_PL, position_ids=(mask_PL.cumsum(-1) - 1).clamp_min(0),
                         use_cache=True, **extra)
        repeat_R = torch.arange(len(prompts), device=self.device).repeat_interleave(spec.n)
        out.past_key_values.reorder_cache(repeat_R)
        logits_RV = out.logits[:, -1].float()[repeat_R]
        mask_RS = torch.cat([mask_PL[repeat_R], mask_PL.new_ones(len(repeat_R), spec.max_tokens)], dim=1)
        seen_RV = None
        if spec.repetition_penalty != 1.0:
            vocab = logits_RV.shape[-1]  # ids past the output vocabulary cannot be generated: nothing to penalise
            counts_PV = torch.zeros(len(prompts), vocab + 1, device=self.device)
            counts_PV.scatter_add_(1, ids_PL.clamp(max=vocab), mask_PL.float())
            seen_RV = (counts_PV[:, :vocab] > 0)[repeat_R]
        batch = _Batch(longest, torch.arange(len(repeat_R), device=self.device), out.past_key_values, mask_RS,
                       mask_RS[:, :longest].sum(-1), seen_RV)
        return batch, logits_RV

    def _decode_step(self, batch: _Batch, tokens_B: torch.Tensor, t: int) -> torch.Tensor:
        """Feed the tokens chosen at step t (position prompt length + t) and return the next logits_BV (float32)."""
        if batch.seen_BV is not None:
            batch.seen_BV[torch.arange(len(tokens_B), device=self.device), tokens_B] = True
        out = self.model(input_ids=tokens_B[:, None], attention_mask=batch.mask_BS[:, :batch.width + t + 1],
                         position_ids=(batch.prompt_lens_B + t)[:, None], past_key_values=batch.cache, use_cache=True)
        batch.cache = out.past_key_values
        return out.logits[:, -1].float()

    def _generations(self, tokens_RT: list[list[int]], logprobs_RT: list[list[float]], n: int
                     ) -> list[list[Generation]]:
        """Rows cut after their first stop token (kept), grouped per prompt."""
        gens = []
        stops = set(self.stop_token_ids)
        for ids, logprobs in zip(tokens_RT, logprobs_RT):
            first = next((i for i, token in enumerate(ids) if token in stops), None)
            end = len(ids) if first is None else first + 1
            gens.append(Generation(ids[:end], logprobs[:end], "length" if first is None else "stop"))
        return [gens[i:i + n] for i in range(0, len(gens), n)]

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in named_tensors:
                params[name].copy_(tensor.to(params[name].dtype))

    def sleep(self) -> None:
        """Nothing to release: the HF engine keeps no KV cache between calls."""

    def wake_up(self) -> None:
        """Nothing to restore (see sleep)."""


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """KV-cache bytes one token occupies (keys and values of every layer), from a transformers config."""
    text = config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    return 2 * text.num_hidden_layers * kv_heads * head_dim * dtype.itemsize


def stop_token_ids(model_path: str, tokenizer) -> list[int]:
    """The tokens that end a sample, as vLLM stops: the tokenizer's eos and every eos id of the model's
    `generation_config.json` (Llama-3's <|eot_id|>, Gemma's <end_of_turn>, Phi-3's <|end|> end a chat turn but
    are not the tokenizer's eos)."""
    from transformers import GenerationConfig

    try:
        extra = GenerationConfig.from_pretrained(model_path, local_files_only=True).eos_token_id
    except OSError:  # no generation_config.json
        extra = None
    extra = [] if extra is None else [extra] if isinstance(extra, int) else list(extra)
    eos = tokenizer.eos_token_id
    return sorted({*([] if eos is None else [eos]), *extra})


def warn_ignored_generation_config(model, model_path: str) -> None:
    """Warn once if the model's generation_config sets a logits processor that `model.generate` applied and this
    engine does not (it samples from the SamplingSpec alone, as the vLLM engine does)."""
    config = getattr(model, "generation_config", None)
    if config is None:
        return
    default, unset = type(config)(), (None, 0, False, [], {})
    found = [f for f in IGNORED_GENERATION_FIELDS
             if getattr(config, f, None) not in unset and getattr(config, f, None) != getattr(default, f, None)]
    if found:
        warnings.warn(f"{model_path}: generation_config sets {', '.join(found)}; the HF rollout engine samples "
                      "from the run's sampling settings only and ignores them", stacklevel=3)
