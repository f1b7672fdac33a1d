"""The exact probability that a causal LM's 2-token response to one prompt contains a bad token
(`--analytic_bad_word_calc`): P(bad) = sum_{a in B} p(a) + sum_{a not in B} p(a) · sum_{b in B} p(b|a),
in log space, with one batched forward over every first token. It knows nothing about training.

Sampling conventions it matches: plain ancestral sampling from softmax(logits / temperature) over the whole
vocabulary; a first token equal to EOS ends the response (it is bad only if EOS is in B).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


@torch.no_grad()
def next_token_logprobs_V(model: torch.nn.Module, ids_BT: torch.Tensor, temperature: float = 1.0,
                          layout=None) -> torch.Tensor:
    """float32 [B, V]: log p(next token | each row), rows unpadded and of equal length. `layout`: the
    `rlhf.models.layout.SequenceLayout` the model was built for (None: plain padded rows)."""
    if layout is None:
        logits = model(input_ids=ids_BT, use_cache=False).logits
    else:  # a model built for packed rows needs explicit boundaries
        laid = layout.lay_out(ids_BT, torch.ones_like(ids_BT))
        logits = laid.to_padded(model(**laid.kwargs).logits)
    return torch.log_softmax(logits[:, -1].float() / temperature, dim=-1)


@torch.no_grad()
def second_token_logprobs_VV(model: torch.nn.Module, prompt_ids: Sequence[int], vocab_size: int,
                             temperature: float = 1.0, batch_size: int = 1024, layout=None) -> torch.Tensor:
    """float32 [V, V]: row a holds log p(b | prompt, a) for every b (first tokens batched)."""
    device = next(model.parameters()).device
    prompt = torch.tensor(list(prompt_ids), device=device)
    rows = []
    for a0 in range(0, vocab_size, batch_size):
        first = torch.arange(a0, min(vocab_size, a0 + batch_size), device=device)
        ids = torch.cat([prompt.expand(len(first), -1), first[:, None]], dim=1)
        rows.append(next_token_logprobs_V(model, ids, temperature, layout))
    return torch.cat(rows)


def log_p_bad(first_V: torch.Tensor, second_VV: torch.Tensor, bad_ids: Sequence[int],
              eos_token_id: int | None = None) -> torch.Tensor:
    """log P(a 2-token response has a token in `bad_ids`) from the first-token log-probs [V] and the
    second-token log-probs [V, V] (row = first token). A first EOS ends the response."""
    V = first_V.shape[0]
    bad = torch.zeros(V, dtype=torch.bool, device=first_V.device)
    bad[list(bad_ids)] = True
    continues = ~bad
    if eos_token_id is not None:
        continues[eos_token_id] = False
    terms = [first_V[bad]]
    if bool(continues.any()):
        terms.append(first_V[continues] + torch.logsumexp(second_VV[continues][:, bad], dim=-1))
    return torch.logsumexp(torch.cat(terms), dim=0)

