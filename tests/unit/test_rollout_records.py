"""Engine outputs become padded Rollout records with exact masks; the HF fallback engine reports the
same log-probs as the actor computes."""

import torch

from rlhf.assets import EMBEDDED_MODEL_DIR
from rlhf.engines.hf_engine import HFGenerateEngine
from rlhf.engines.rollout import Generation, SamplingSpec, to_rollout
from rlhf.models.loading import load_causal_lm, load_tokenizer
from tests.references import sequence_logprobs


class _Tok:
    def batch_decode(self, ids, skip_special_tokens):
        return [" ".join(map(str, x)) for x in ids]


def test_to_rollout_layout():
    gens = [[Generation([7, 8, 2], [-0.1, -0.2, -0.3], "stop"), Generation([9], [-0.4], "length")],
            [Generation([5, 6], [-0.5, -0.6], "length"), Generation([4, 4, 4], [-0.7, -0.8, -0.9], "stop")]]
    r = to_rollout([[10, 11], [12, 13, 14]], gens, pad_id=0, tokenizer=_Tok(), prompts_text=["p0", "p1"],
                   labels=["a", "b"])
    assert r.sequences_BT.tolist() == [[10, 11, 7, 8, 2, 0], [10, 11, 9, 0, 0, 0],
                                       [12, 13, 14, 5, 6, 0], [12, 13, 14, 4, 4, 4]]
    assert r.attention_mask_BT.sum(-1).tolist() == [5, 3, 5, 6]
    # target position t scores token t + 1: the first response token of a 2-token prompt is at t = 1
    assert r.action_mask_BT1.tolist() == [[0, 1, 1, 1, 0], [0, 1, 0, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]
    torch.testing.assert_close(r.rollout_logprobs_BT1[0], torch.tensor([0, -0.1, -0.2, -0.3, 0]))
    torch.testing.assert_close(r.rollout_logprobs_BT1[3], torch.tensor([0, 0, -0.7, -0.8, -0.9]))
    assert r.prompts == ["p0", "p0", "p1", "p1"] and r.labels == ["a", "a", "b", "b"]
    assert r.finish_reasons == ["stop", "length", "length", "stop"]
    assert r.response_lens_B.tolist() == [3, 1, 2, 3]


def test_hf_engine_logprobs_match_actor_and_weights_load():
    tok = load_tokenizer(EMBEDDED_MODEL_DIR)
    engine = HFGenerateEngine(EMBEDDED_MODEL_DIR, dtype=torch.float32, device=torch.device("cpu"),
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    actor = load_causal_lm(EMBEDDED_MODEL_DIR, torch.float32, "sdpa")
    with torch.no_grad():
        for p in actor.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine.load_weights(actor.named_parameters())
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in ["copy 1 :", "a b copy 2 :"]]
    spec = SamplingSpec(n=3, temperature=0.7, top_p=1.0, max_tokens=10)
    gens = engine.generate(prompts, spec, [3, 4])
    assert gens == engine.generate(prompts, spec, [3, 4])  # seeded
    r = to_rollout(prompts, gens, tok.pad_token_id, tok, ["x", "y"], [None, None])
    with torch.no_grad():
        lp = sequence_logprobs(actor, r.sequences_BT, r.attention_mask_BT, temperature=0.7)
    assert r.action_mask_BT1.sum() > 10
    assert float(((lp - r.rollout_logprobs_BT1).abs() * r.action_mask_BT1).max()) < 1e-4
