"""Greedy coordinate gradient (GCG; Zou et al. 2023, as nanoGCG runs it, which is what the RePULSe fork calls): find
the suffix of token ids that, placed after a goal, makes a causal LM most likely to continue with a target string.
Each step takes the gradient of the target loss with respect to a one-hot encoding of the suffix, samples
candidates that swap random positions for tokens with the most negative gradient, scores them, and keeps the best.

Pure pieces over tensors (the target loss of a batch of candidate suffixes, the one-hot token gradient, candidate
sampling, the decode/encode filter, one step on a search state) and the loop over steps. Knows nothing of files,
flags, rewards or of sampling completions; the model is frozen and only read.

Shape suffixes: B candidates in a batch, W candidates of one step (the search width), L suffix positions,
K tokens per position, N target tokens, T sequence positions, V vocabulary (the model's embedding rows),
D hidden size.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from rlhf.repulse.gcg_config import GCGSearchConfig
from rlhf.utils import watchdog

INIT_FILLERS = ("!", "x")
"""The suffix starts as this word repeated: "!" as in the GCG paper and the fork's evaluate_gcg_sz ("! ! ... !"),
else "x" (nanoGCG's default "x x ... x") where "!" does not encode to that many allowed tokens (the embedded tiny
vocabulary has no "!")."""

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(logits_BNV float32, target_ids_N) -> loss_B float32: how far each candidate is from eliciting the target."""


@dataclass(frozen=True)
class AttackPrompt:
    """The token ids around the optimised suffix, int64 1-D tensors on the model's device: `before_ids` (the
    template's head and the goal), `after_ids` (the template's tail, e.g. the assistant header; may be empty) and
    `target_ids` (the string to elicit, non-empty). The policy sees before + suffix + after, then the target."""

    before_ids: torch.Tensor
    after_ids: torch.Tensor
    target_ids: torch.Tensor

    def prompt_ids(self, suffix_ids_L: torch.Tensor) -> torch.Tensor:
        """int64 [T]: before + suffix + after, the prompt completions are sampled from."""
        return torch.cat([self.before_ids, suffix_ids_L.to(self.before_ids.device), self.after_ids])

    def without_suffix(self) -> torch.Tensor:
        """int64 [T]: before + after, the prompt as the goal alone would give it."""
        return torch.cat([self.before_ids, self.after_ids])


# --- losses ---------------------------------------------------------------------------------------

def nll_loss_B(logits_BNV: torch.Tensor, target_ids_N: torch.Tensor) -> torch.Tensor:
    """float32 [B]: the mean over target tokens of -log p(target token | everything before it)."""
    logprobs_BNV = torch.log_softmax(logits_BNV.float(), dim=-1)
    target_BN = target_ids_N.expand(logits_BNV.shape[0], -1)
    return -logprobs_BNV.gather(-1, target_BN.unsqueeze(-1)).squeeze(-1).mean(-1)


def mellowmax_loss_B(logits_BNV: torch.Tensor, target_ids_N: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """float32 [B]: mellowmax_alpha of the target tokens' negated logits, (logsumexp(alpha * x) - log N) / alpha
    (nanoGCG's --use_mellowmax loss: a soft maximum that concentrates on the worst-predicted target token)."""
    target_BN = target_ids_N.expand(logits_BNV.shape[0], -1)
    x_BN = -logits_BNV.float().gather(-1, target_BN.unsqueeze(-1)).squeeze(-1)
    return (torch.logsumexp(alpha * x_BN, dim=-1) - math.log(x_BN.shape[-1])) / alpha


TARGET_LOSSES: dict[str, Callable[..., torch.Tensor]] = {"nll": nll_loss_B, "mellowmax": mellowmax_loss_B}


def target_loss_fn(search: GCGSearchConfig) -> LossFn:
    """The loss `search` asks for (--gcg_use_mellowmax, --gcg_mellowmax_alpha)."""
    if search.use_mellowmax:
        return functools.partial(TARGET_LOSSES["mellowmax"], alpha=search.mellowmax_alpha)
    return TARGET_LOSSES["nll"]


# --- forward passes -------------------------------------------------------------------------------

def _target_logits_BNV(model: torch.nn.Module, num_target: int, **inputs: torch.Tensor) -> torch.Tensor:
    """The logits that predict the last `num_target` positions of each row: [B, N, V]. Asks the model for only
    the last N + 1 positions where it supports `logits_to_keep` (the full [B, T, V] logits of a large vocabulary
    would be most of a step's memory)."""
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        inputs["logits_to_keep"] = num_target + 1
    logits_BTV = model(**inputs, use_cache=False).logits
    return logits_BTV[:, -num_target - 1:-1]


class CandidateScores(NamedTuple):
    """loss_B: float32 [B] target loss per candidate (CPU); target_hit_B: bool [B], whether greedy decoding of
    the target positions gives exactly the target (nanoGCG's early-stop test)."""

    loss_B: torch.Tensor
    target_hit_B: torch.Tensor


@torch.no_grad()
def score_candidates(model: torch.nn.Module, prompt: AttackPrompt, suffix_ids_BL: torch.Tensor,
                     loss_fn: LossFn = nll_loss_B, batch_size: int | None = None) -> CandidateScores:
    """The target loss of each candidate suffix, `batch_size` candidates per forward (default: all at once).
    Rows are unpadded and of equal length, so no attention mask is needed."""
    device = prompt.before_ids.device
    suffix_ids_BL = suffix_ids_BL.to(device)
    B, N = suffix_ids_BL.shape[0], prompt.target_ids.numel()
    losses, hits = [], []
    for start in range(0, B, batch_size or max(B, 1)):
        part_BL = suffix_ids_BL[start:start + (batch_size or B)]
        rows = part_BL.shape[0]
        ids_BT = torch.cat([prompt.before_ids.expand(rows, -1), part_BL, prompt.after_ids.expand(rows, -1),
                            prompt.target_ids.expand(rows, -1)], dim=1)
        logits_BNV = _target_logits_BNV(model, N, input_ids=ids_BT)
        losses.append(loss_fn(logits_BNV, prompt.target_ids).float().cpu())
        hits.append((logits_BNV.argmax(-1) == prompt.target_ids).all(-1).cpu())
    return CandidateScores(torch.cat(losses), torch.cat(hits))


def target_loss_B(model: torch.nn.Module, prompt: AttackPrompt, suffix_ids_BL: torch.Tensor,
                  loss_fn: LossFn = nll_loss_B, batch_size: int | None = None) -> torch.Tensor:
    """float32 [B]: the target loss of each candidate suffix (see `score_candidates`)."""
    return score_candidates(model, prompt, suffix_ids_BL, loss_fn, batch_size).loss_B


def token_gradients_LV(model: torch.nn.Module, prompt: AttackPrompt, suffix_ids_L: torch.Tensor,
                       loss_fn: LossFn = nll_loss_B) -> torch.Tensor:
    """float32 [L, V]: d loss / d one_hot[l, v] at the one-hot encoding of `suffix_ids_L`, where the suffix enters
    the model as one_hot @ E (E: the input embedding matrix [V, D]). Entry [l, v] is the first-order change of the
    loss from swapping position l's token for v (up to the constant of the current token). Only the one-hot
    gets a gradient; the model's parameters are not touched."""
    embed = model.get_input_embeddings()
    E_VD = embed.weight
    suffix_ids_L = suffix_ids_L.to(E_VD.device)
    with torch.enable_grad():
        one_hot_LV = torch.zeros(suffix_ids_L.numel(), E_VD.shape[0], dtype=E_VD.dtype, device=E_VD.device)
        one_hot_LV.scatter_(1, suffix_ids_L[:, None], 1.0)
        one_hot_LV.requires_grad_(True)
        embeds_TD = torch.cat([embed(prompt.before_ids).detach(), one_hot_LV @ E_VD.detach(),
                               embed(prompt.after_ids).detach(), embed(prompt.target_ids).detach()])
        logits_1NV = _target_logits_BNV(model, prompt.target_ids.numel(), inputs_embeds=embeds_TD[None])
        loss = loss_fn(logits_1NV, prompt.target_ids).sum()
        (grad_LV,) = torch.autograd.grad(loss, [one_hot_LV])
    return grad_LV.float()


# --- candidates -----------------------------------------------------------------------------------

def disallowed_token_ids(tokenizer, vocab_size: int, allow_non_ascii: bool = False) -> torch.Tensor:
    """int64 [n] sorted: ids the suffix may not use: special tokens, embedding rows past the tokenizer's vocabulary,
    and unless `allow_non_ascii` the tokens whose text is not printable ASCII (nanoGCG's rule)."""
    blocked = set(tokenizer.all_special_ids) | set(range(len(tokenizer), vocab_size))
    if not allow_non_ascii:
        ids = range(min(len(tokenizer), vocab_size))
        texts = tokenizer.batch_decode([[i] for i in ids])
        blocked |= {i for i, text in zip(ids, texts) if not (text.isascii() and text.isprintable())}
    return torch.tensor(sorted(i for i in blocked if 0 <= i < vocab_size), dtype=torch.long)


def initial_suffix_ids(tokenizer, length: int, disallowed_ids: torch.Tensor) -> torch.Tensor:
    """int64 [length]: INIT_FILLERS[0] repeated ("! ! ... !", tokenized as text, as nanoGCG tokenizes its initial
    string), else INIT_FILLERS[1], whichever first encodes to `length` allowed tokens. A ValueError when none does."""
    blocked = set(disallowed_ids.tolist())
    for filler in INIT_FILLERS:
        ids = tokenizer(" ".join([filler] * length), add_special_tokens=False)["input_ids"]
        if len(ids) == length and not blocked.intersection(ids):
            return torch.tensor(ids, dtype=torch.long)
    raise ValueError(f"none of {', '.join(repr(f) for f in INIT_FILLERS)} repeated {length} times encodes to "
                     f"{length} allowed tokens of this tokenizer, so the suffix has no starting point")


def num_choices(vocab_size: int, num_disallowed: int, topk: int) -> int:
    """The top-k actually used: at most the allowed tokens less the current one (a swap always changes it)."""
    return max(0, min(topk, vocab_size - num_disallowed - 1))


def sample_candidates_WL(suffix_ids_L: torch.Tensor, grad_LV: torch.Tensor, *, search_width: int, topk: int,
                         n_replace: int, disallowed_ids: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """int64 [W, L] on the CPU: `search_width` copies of the suffix, each with `n_replace` distinct random positions
    set to a random one of that position's `topk` tokens of most negative gradient. Disallowed tokens and the
    position's current token are never picked, so every candidate differs from the suffix in exactly `n_replace`
    positions. `topk` is capped by `num_choices`."""
    suffix_ids_L = suffix_ids_L.cpu()
    grad_LV = grad_LV.detach().float().cpu().clone()
    L, V = grad_LV.shape
    grad_LV[:, disallowed_ids] = float("inf")
    grad_LV[torch.arange(L), suffix_ids_L] = float("inf")
    k = min(topk, int(torch.isfinite(grad_LV).sum(-1).min()))
    if k < 1:
        raise ValueError("no allowed token is left to swap in: every vocabulary entry is disallowed")
    top_LK = (-grad_LV).topk(k, dim=1).indices
    positions_WR = torch.argsort(torch.rand(search_width, L, generator=generator), dim=1)[:, :n_replace]
    picks_WR = torch.randint(0, k, (search_width, n_replace), generator=generator)
    return suffix_ids_L.repeat(search_width, 1).scatter_(1, positions_WR, top_LK[positions_WR, picks_WR])


def filter_round_trip(candidates_WL: torch.Tensor, tokenizer) -> torch.Tensor:
    """The candidates (rows, in order) whose ids come back unchanged from decode then encode (without special
    tokens), so the suffix is a string that tokenizes to what was optimised (nanoGCG's filter_ids)."""
    texts = tokenizer.batch_decode(candidates_WL.tolist())
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    keep = [i for i, (row, ids) in enumerate(zip(candidates_WL.tolist(), encoded)) if row == list(ids)]
    return candidates_WL[keep]


# --- the search -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class GCGState:
    """Where the search stands. `buffer`: (loss, suffix int64 [L]) pairs sorted by loss, the search continues from
    the first; `best_loss`/`best_ids_L`: the lowest loss seen and its suffix; `steps`: steps taken;
    `target_hit`: a scored candidate greedily decodes to the target; `empty_steps`: steps whose candidates were
    all filtered out (the state then stays as it was)."""

    buffer: tuple[tuple[float, torch.Tensor], ...]
    best_loss: float
    best_ids_L: torch.Tensor
    steps: int = 0
    target_hit: bool = False
    empty_steps: int = 0

    @property
    def current_ids_L(self) -> torch.Tensor:
        return self.buffer[0][1]


def add_to_buffer(buffer: Sequence[tuple[float, torch.Tensor]], capacity: int, loss: float,
                  ids_L: torch.Tensor) -> tuple[tuple[float, torch.Tensor], ...]:
    """nanoGCG's attack buffer after offering it (loss, ids): capacity 0 (plain GCG) holds just the newest entry,
    whatever its loss; otherwise the `capacity` lowest losses are kept (a new entry replaces the worst when it is
    lower)."""
    if capacity == 0:
        return ((loss, ids_L),)
    entries = list(buffer)
    if len(entries) < capacity:
        entries.append((loss, ids_L))
    elif loss < entries[-1][0]:
        entries[-1] = (loss, ids_L)
    return tuple(sorted(entries, key=lambda entry: entry[0]))


def initial_buffer_ids(init_ids_L: torch.Tensor, buffer_size: int, allowed_ids: torch.Tensor,
                       generator: torch.Generator) -> torch.Tensor:
    """int64 [max(1, buffer_size), L]: the initial suffix, then (nanoGCG) random suffixes of allowed tokens filling
    the rest of the buffer."""
    num_random = max(0, buffer_size - 1)
    picks = torch.randint(0, allowed_ids.numel(), (num_random, init_ids_L.numel()), generator=generator)
    return torch.cat([init_ids_L.cpu()[None], allowed_ids[picks]])


def init_state(model: torch.nn.Module, prompt: AttackPrompt, rows_BL: torch.Tensor, buffer_size: int,
               loss_fn: LossFn = nll_loss_B) -> GCGState:
    """The state before the first step: `rows_BL` (see `initial_buffer_ids`) scored and put in the buffer."""
    losses = target_loss_B(model, prompt, rows_BL, loss_fn).tolist()
    buffer: tuple[tuple[float, torch.Tensor], ...] = ()
    for loss, ids_L in zip(losses, rows_BL.cpu()):
        buffer = add_to_buffer(buffer, max(1, buffer_size), loss, ids_L)
    return GCGState(buffer, buffer[0][0], buffer[0][1])


def gcg_step(model: torch.nn.Module, prompt: AttackPrompt, state: GCGState, search: GCGSearchConfig, *,
             disallowed_ids: torch.Tensor, generator: torch.Generator, tokenizer=None,
             loss_fn: LossFn = nll_loss_B) -> GCGState:
    """One GCG step from `state.current_ids_L`: token gradients, `search.search_width` candidates, (with
    `tokenizer`) the round-trip filter, scores in batches of `search.candidate_batch_size`, and the best candidate
    offered to the buffer. `best_loss` never increases: it is the minimum over every suffix scored so far."""
    current_L = state.current_ids_L
    grad_LV = token_gradients_LV(model, prompt, current_L, loss_fn)
    candidates_WL = sample_candidates_WL(current_L, grad_LV, search_width=search.search_width, topk=search.topk,
                                         n_replace=search.n_replace, disallowed_ids=disallowed_ids,
                                         generator=generator)
    if tokenizer is not None:
        candidates_WL = filter_round_trip(candidates_WL, tokenizer)
    if candidates_WL.shape[0] == 0:
        return GCGState(state.buffer, state.best_loss, state.best_ids_L, state.steps + 1, state.target_hit,
                        state.empty_steps + 1)
    scores = score_candidates(model, prompt, candidates_WL, loss_fn, search.candidate_batch_size)
    i = int(scores.loss_B.argmin())
    loss, ids_L = float(scores.loss_B[i]), candidates_WL[i]
    buffer = add_to_buffer(state.buffer, search.buffer_size, loss, ids_L)
    best = (loss, ids_L) if loss < state.best_loss else (state.best_loss, state.best_ids_L)
    return GCGState(buffer, best[0], best[1], state.steps + 1, state.target_hit or bool(scores.target_hit_B.any()),
                    state.empty_steps)


def run_gcg(model: torch.nn.Module, prompt: AttackPrompt, init_ids_L: torch.Tensor, search: GCGSearchConfig, *,
            disallowed_ids: torch.Tensor, generator: torch.Generator, tokenizer=None) -> GCGState:
    """`search.num_steps` GCG steps (fewer with `search.early_stop` once the target is hit) from `init_ids_L`;
    pass `tokenizer` to filter candidates by round trip (--gcg_filter_ids). Returns the final state: its
    `best_ids_L` is the attack's suffix."""
    loss_fn = target_loss_fn(search)
    vocab_size = model.get_input_embeddings().weight.shape[0]
    allowed = torch.tensor(sorted(set(range(vocab_size)) - set(disallowed_ids.tolist())), dtype=torch.long)
    rows_BL = initial_buffer_ids(init_ids_L, search.buffer_size, allowed, generator)
    state = init_state(model, prompt, rows_BL, search.buffer_size, loss_fn)
    for _ in range(search.num_steps):
        with watchdog.stage("gcg step"):  # progress for the watchdog (a goal may take minutes)
            state = gcg_step(model, prompt, state, search, disallowed_ids=disallowed_ids, generator=generator,
                             tokenizer=tokenizer, loss_fn=loss_fn)
        if search.early_stop and state.target_hit:
            break
    return state
