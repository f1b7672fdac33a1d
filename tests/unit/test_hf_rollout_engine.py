"""The batched HF rollout engine: a prompt's samples do not depend on the other prompts of the call, on how the
call is split into decode batches, or on max_tokens beyond their length; they equal a plain per-row loop without
cache or padding drawing from the same streams; log-probs equal a teacher-forced forward; rows end at the stop
token (kept) or at max_tokens. Logits of a batch differ from a one-prompt call's in the last float bits only
(batched kernels round differently), so tokens are compared exactly and log-probs to 1e-5 (fp32)."""

import pytest
import torch

from rlhf.assets import EMBEDDED_MODEL_DIR
from rlhf.engines import hf_engine
from rlhf.engines.hf_engine import HFGenerateEngine, warn_ignored_generation_config
from rlhf.engines.rollout import SamplingSpec, to_rollout
from rlhf.engines.token_sampling import PromptStreams, next_tokens
from rlhf.models.loading import load_causal_lm, load_tokenizer
from rlhf.utils import preemption
from tests.references import sequence_logprobs

TEXTS = ["copy 1 :", "a b c d copy 2 3 4 :", ":", "x copy 7 :", "q w e r t y copy 5 :"]
SEEDS = [11, 12, 13, 14, 15]
SPECS = {"sample": SamplingSpec(n=3, temperature=1.0, top_p=1.0, max_tokens=10),
         "top_p_penalty": SamplingSpec(n=3, temperature=0.7, top_p=0.8, max_tokens=10, repetition_penalty=1.3),
         "greedy_penalty": SamplingSpec(n=2, temperature=0.0, top_p=1.0, max_tokens=10, repetition_penalty=1.5)}
FREQUENT_TOKEN = "w16"  # a stop token the tiny policy emits often, so that most rows stop early
LOGPROB_TOL = 1e-5


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(EMBEDDED_MODEL_DIR)


@pytest.fixture(scope="module")
def prompts(tok):
    return [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]


def make_engine(tok, eos_token_id=None, **kwargs) -> HFGenerateEngine:
    eos = tok.eos_token_id if eos_token_id is None else eos_token_id
    return HFGenerateEngine(EMBEDDED_MODEL_DIR, dtype=torch.float32, device=torch.device("cpu"), eos_token_id=eos,
                            pad_token_id=tok.pad_token_id, **kwargs)


def assert_same_samples(got, want) -> None:
    assert [[(g.token_ids, g.finish_reason) for g in gs] for gs in got] == \
           [[(g.token_ids, g.finish_reason) for g in gs] for gs in want]
    diffs = [abs(a - b) for gs, hs in zip(got, want) for g, h in zip(gs, hs) for a, b in zip(g.logprobs, h.logprobs)]
    assert max(diffs) < LOGPROB_TOL


@pytest.mark.parametrize("kind", list(SPECS))
def test_samples_do_not_depend_on_the_batch(tok, prompts, kind):
    engine, spec = make_engine(tok), SPECS[kind]
    full = engine.generate(prompts, spec, SEEDS)
    alone = [engine.generate([p], spec, [s])[0] for p, s in zip(prompts, SEEDS)]
    assert_same_samples(full, alone)
    order = [3, 0, 4]  # another subset, another order, with a repeated prompt under another seed
    mixed = engine.generate([prompts[i] for i in order] + [prompts[0]], spec, [SEEDS[i] for i in order] + [99])
    assert_same_samples(mixed[:3], [full[i] for i in order])
    # split into one decode batch per prompt (what a small KV budget, or more engines, does)
    split = make_engine(tok, max_batch_kv_bytes=1).generate(prompts, spec, SEEDS)
    assert_same_samples(split, full)
    if spec.temperature > 0:
        assert len({tuple(g.token_ids) for gs in full for g in gs}) == len(prompts) * spec.n
        assert mixed[3] != full[0], "another seed gives other samples"


def test_longer_max_tokens_extends_the_same_samples(tok, prompts):
    engine = make_engine(tok)
    short = engine.generate(prompts, SamplingSpec(n=2, temperature=1.0, top_p=1.0, max_tokens=5), SEEDS)
    long = engine.generate(prompts, SamplingSpec(n=2, temperature=1.0, top_p=1.0, max_tokens=70), SEEDS)
    for gs, hs in zip(short, long):
        for g, h in zip(gs, hs):
            assert h.token_ids[:len(g.token_ids)] == g.token_ids


def reference_decode(model, prompt: list[int], seed: int, spec: SamplingSpec, stop: int) -> list[tuple]:
    """One prompt's samples the plain way: per row, a full forward of the whole sequence per token (no cache, no
    padding, batch of one), tokens chosen by `next_tokens` with the row's draws of the prompt's stream."""
    streams = PromptStreams([seed], spec.n, spec.max_tokens, torch.device("cpu"))
    draws_TN = torch.stack([streams.uniforms(t) for t in range(spec.max_tokens)])
    samples = []
    for k in range(spec.n):
        seq, logprobs = list(prompt), []
        for t in range(spec.max_tokens):
            with torch.no_grad():
                logits_1V = model(torch.tensor([seq])).logits[:, -1].float()
            seen_1V = torch.zeros_like(logits_1V, dtype=torch.bool)
            seen_1V[0, seq] = True
            token_1, logprob_1 = next_tokens(logits_1V, temperature=spec.temperature, top_p=spec.top_p,
                                             repetition_penalty=spec.repetition_penalty, seen_BV=seen_1V,
                                             uniforms_B=draws_TN[t, k:k + 1])
            seq.append(int(token_1))
            logprobs.append(float(logprob_1))
            if seq[-1] == stop:
                break
        samples.append((seq[len(prompt):], logprobs, "stop" if seq[-1] == stop else "length"))
    return samples


@pytest.mark.parametrize("kind", list(SPECS))
def test_batched_decode_equals_a_plain_loop_and_stops_rows(tok, prompts, kind, monkeypatch):
    stop = tok.convert_tokens_to_ids(FREQUENT_TOKEN)
    engine = make_engine(tok, eos_token_id=stop)
    spec = SamplingSpec(n=4, temperature=SPECS[kind].temperature, top_p=SPECS[kind].top_p, max_tokens=40,
                        repetition_penalty=SPECS[kind].repetition_penalty)
    kept = []
    keep = hf_engine._Batch.keep
    monkeypatch.setattr(hf_engine._Batch, "keep", lambda self, live: kept.append(len(live)) or keep(self, live))
    gens = engine.generate(prompts, spec, SEEDS)
    model = load_causal_lm(EMBEDDED_MODEL_DIR, torch.float32, "sdpa").eval()
    for gs, prompt, seed in zip(gens, prompts, SEEDS):
        want = reference_decode(model, prompt, seed, spec, stop)
        assert [(g.token_ids, g.finish_reason) for g in gs] == [(ids, reason) for ids, _, reason in want]
        for g, (_, logprobs, _) in zip(gs, want):
            torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(logprobs), rtol=0, atol=LOGPROB_TOL)
    for g in (g for gs in gens for g in gs):  # stop token kept and only at the end; otherwise max_tokens
        assert stop not in g.token_ids[:-1]
        assert (g.finish_reason, len(g.token_ids) == 40) == (("stop", False) if g.token_ids[-1] == stop
                                                              else ("length", True))
    reasons = [g.finish_reason for gs in gens for g in gs]
    assert reasons.count("stop") > len(reasons) // 2 and "length" in reasons
    assert kept, "rows that stopped were dropped from the batch"


def test_logprobs_equal_a_teacher_forced_forward(tok, prompts):
    engine = make_engine(tok)
    spec = SPECS["top_p_penalty"]
    gens = engine.generate(prompts, spec, SEEDS)
    r = to_rollout(prompts, gens, tok.pad_token_id, tok, TEXTS, [None] * len(TEXTS))
    model = load_causal_lm(EMBEDDED_MODEL_DIR, torch.float32, "sdpa").eval()
    with torch.no_grad():
        lp_BT1 = sequence_logprobs(model, r.sequences_BT, r.attention_mask_BT, temperature=spec.temperature)
    assert r.action_mask_BT1.sum() == sum(len(g.token_ids) for gs in gens for g in gs) > 100
    assert float(((lp_BT1 - r.rollout_logprobs_BT1).abs() * r.action_mask_BT1).max()) < LOGPROB_TOL


def test_zero_tokens_empty_calls_and_ignored_generation_settings(tok, prompts):
    engine = make_engine(tok)
    assert engine.generate([], SPECS["sample"], []) == []
    none = engine.generate(prompts[:2], SamplingSpec(n=2, temperature=1.0, top_p=1.0, max_tokens=0), SEEDS[:2])
    assert [[(g.token_ids, g.finish_reason) for g in gs] for gs in none] == [[([], "length")] * 2] * 2
    engine.model.generation_config.no_repeat_ngram_size = 3
    with pytest.warns(UserWarning, match="generation_config sets no_repeat_ngram_size"):
        warn_ignored_generation_config(engine.model, "policy")
    with pytest.raises(ValueError, match="max_batch_kv_bytes must be positive"):
        make_engine(tok, max_batch_kv_bytes=0)


def test_sigterm_cuts_the_decode_short_inside_an_abandonable_window(tok, prompts, monkeypatch):
    """After SIGTERM the decode of a step that may be abandoned stops after its next token; outside such a window
    (an evaluation, batch inference) it runs to the end."""
    watch = preemption.PreemptionWatch.__new__(preemption.PreemptionWatch)  # no signal handlers in pytest
    watch.requested = watch.hurry = True
    monkeypatch.setattr(preemption, "_ACTIVE", watch)
    engine, spec = make_engine(tok, eos_token_id=-1), SamplingSpec(n=2, temperature=1.0, top_p=1.0, max_tokens=10)
    assert {len(g.token_ids) for gs in engine.generate(prompts, spec, SEEDS) for g in gs} == {10}
    with preemption.abandonable():
        assert {len(g.token_ids) for gs in engine.generate(prompts, spec, SEEDS) for g in gs} == {1}
