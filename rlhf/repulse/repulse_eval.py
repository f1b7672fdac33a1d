"""The RePULSe fork's evaluations after every fit step, for PPO and RePULSe runs alike.

`--analytic_bad_word_calc`: for one prompt and 2-token responses, the exact log P(bad) of the policy, and,
where the V x V responses can be enumerated, the exact expected reward and return (so the toy's curves carry
no sampling noise; with a large vocabulary the row's reward and return are the fit step's sample means).
Runs on every rank (all roles colocated): every rank computes the same numbers, ZeRO-3 forwards stay
collective. `--evaluate_heldout_sampling`: the frontier's numbers on held-out prompts.
"""

from __future__ import annotations

import math

import torch

from rlhf.config.errors import UsageError
from rlhf.data.prompts import Prompt, load_prompts, single_prompt
from rlhf.repulse import repulse_losses
from rlhf.repulse.bad_outputs import log_p_bad, next_token_logprobs_V, second_token_logprobs_VV
from rlhf.repulse.repulse_config import TrainRepulseConfig
from rlhf.rewards.base import RewardInputs, RewardSource
from rlhf.trainers.prompt_eval import splittable

MAX_ENUMERATED = 1 << 20
"""At most this many 2-token responses are enumerated for the exact expected reward."""
SCORE_CHUNK = 4096
"""Responses per reward call while enumerating (bounds a reward model's activation memory)."""


def bad_token_ids(words: str, tokenizer) -> list[int]:
    """The token ids of --bad_words; each word must be exactly one token of the policy's vocabulary."""
    ids = []
    for word in words.split():
        tokens = tokenizer.encode(word, add_special_tokens=False)
        if len(tokens) != 1 or tokens[0] == tokenizer.unk_token_id:
            raise UsageError(f"--bad_words: {word!r} is not one token of the policy's vocabulary (it encodes to "
                             f"{tokens}); list single-token words")
        ids.append(tokens[0])
    return ids


def resolve_bad_words(cfg: TrainRepulseConfig, reward: RewardSource | None) -> str:
    """--bad_words, else the BAD_WORDS a --remote_rm_url file declares; a usage error when neither exists."""
    if cfg.repulse.bad_words:
        return cfg.repulse.bad_words
    declared = getattr(reward, "bad_words", None)
    if declared:
        return " ".join(declared)
    raise UsageError("--analytic_bad_word_calc needs the set of bad words: give --bad_words \"w1 w2 ...\" (single "
                     "tokens of the policy's vocabulary; the fork hard-codes 19 distilgpt2 token ids for its "
                     "toxicity model), or a --remote_rm_url file that defines BAD_WORDS")


class AnalyticEvaluator:
    """Exact 2-token statistics of p for the single prompt (see the module docstring)."""

    def __init__(self, cfg: TrainRepulseConfig, tokenizer, prompt_text: str, prompt_ids: list[int], label,
                 reward: RewardSource, ref_model: torch.nn.Module | None, ref_layout=None,
                 vocab_size: int | None = None, period: int = 1) -> None:
        self.period = period  # steps between evaluations (a fit step)
        self.cfg, self.tokenizer, self.reward, self.ref_model = cfg, tokenizer, reward, ref_model
        self.ref_layout = ref_layout
        self.prompt_text, self.prompt_ids, self.label = prompt_text, prompt_ids, label
        self.bad_words = resolve_bad_words(cfg, reward)
        self.bad_ids = bad_token_ids(self.bad_words, tokenizer)
        self.eos = tokenizer.eos_token_id
        self.temperature = cfg.rollout.temperature
        self.exact_reward = vocab_size is None or vocab_size * vocab_size <= MAX_ENUMERATED
        self._rewards = None  # [V, V] rewards of every response (fixed: the reward does not change)

    def describe(self) -> str:
        """The line printed at start-up: what is evaluated and how."""
        how = "the exact expected reward and return by enumerating every 2-token response" if self.exact_reward \
            else (f"reward and return: the fit step's sample means (more than {MAX_ENUMERATED} 2-token responses to "
                  "enumerate)")
        return (f"analytic evaluation after every fit step: exact log P(bad) of 2-token responses to "
                f"{self.prompt_text!r}, bad words {self.bad_words!r}; {how}")

    def __call__(self, trainer) -> dict[str, float]:
        actor = trainer.roles.actor
        actor.model.eval()
        first, second = self._logprobs(actor.model.engine, actor.infer_batcher.layout)
        out = {"log_p_bad": float(log_p_bad(first, second, self.bad_ids, self.eos))}
        out["p_bad"] = math.exp(out["log_p_bad"])
        if not self.exact_reward:
            return out
        joint = self._joint(first, second)  # [V, V] log-prob of each response (row a = eos: [eos] alone)
        rewards = self._all_rewards(first.shape[0])
        rp = self.cfg.repulse
        shaped = rewards
        if rp.reward_transform is not None:
            transform = repulse_losses.REWARD_TRANSFORMS[rp.reward_transform]
            shaped = transform(rewards, rp.transform_alpha, rp.transform_beta, rp.threshold)
        probs = joint.exp()
        out["reward_mean"] = float((probs * rewards).sum())
        returns = shaped
        if self.ref_model is not None and self.cfg.algo.init_kl_coef > 0:
            ref_joint = self._joint(*self._logprobs(self.ref_model, self.ref_layout))
            returns = shaped - self.cfg.algo.init_kl_coef * torch.where(probs > 0, joint - ref_joint, 0.0)
        out["return_mean"] = float((probs * returns).sum())
        return out

    @torch.no_grad()
    def _logprobs(self, module: torch.nn.Module, layout) -> tuple[torch.Tensor, torch.Tensor]:
        device = next(module.parameters()).device
        first = next_token_logprobs_V(module, torch.tensor([self.prompt_ids], device=device), self.temperature,
                                      layout)[0]
        second = second_token_logprobs_VV(module, self.prompt_ids, first.shape[0], self.temperature, layout=layout)
        return first.float().cpu(), second.float().cpu()

    def _joint(self, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        """log p(a, b) for every 2-token response; the row of a = EOS holds log p(eos) at b = 0 (the response
        [eos]) and -inf elsewhere."""
        joint = first[:, None] + second
        if self.eos is not None:
            joint[self.eos] = float("-inf")
            joint[self.eos, 0] = first[self.eos]
        return joint

    def _all_rewards(self, V: int) -> torch.Tensor:
        if self._rewards is not None:
            return self._rewards
        if V * V > MAX_ENUMERATED:
            raise UsageError(f"--analytic_bad_word_calc enumerates all {V} x {V} 2-token responses for the exact "
                             f"reward; more than {MAX_ENUMERATED}: use a smaller vocabulary")
        pairs = [[a, b] if a != self.eos else [a] for a in range(V) for b in range(V)]
        responses = self.tokenizer.batch_decode(pairs, skip_special_tokens=True)
        queries = [self.prompt_text + r for r in responses]
        sequences = [self.prompt_ids + p for p in pairs]
        width = max(len(s) for s in sequences)
        pad = self.tokenizer.pad_token_id
        seq = torch.tensor([s + [pad] * (width - len(s)) for s in sequences])
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
        if self.cfg.repulse.rm_max_len is not None:
            seq, mask = seq[:, :self.cfg.repulse.rm_max_len], mask[:, :self.cfg.repulse.rm_max_len]
        parts = []
        for at in range(0, len(queries), SCORE_CHUNK):
            part = slice(at, at + SCORE_CHUNK)
            n = len(queries[part])
            parts.append(self.reward.score(RewardInputs(queries[part], [self.prompt_text] * n, [self.label] * n,
                                                        seq[part], mask[part])).rewards_B.float().cpu())
        self._rewards = torch.cat(parts).reshape(V, V)
        return self._rewards


class HeldoutEvaluator:
    """--evaluate_heldout_sampling: K samples of the policy per held-out prompt (--sampling_iters rounds);
    each sample's reward, return (r - c_KL x k1 KL) and KL go to `out_dir/heldout_<samples drawn>.jsonl`;
    reported: mean reward, return and KL, P(r < --threshold) and the CVaR of the rewards. Collective (every
    rank generates its share, as in a training step)."""

    def __init__(self, cfg: TrainRepulseConfig, prompts: list, out_dir: str, is_writer: bool, unit: int,
                 period: int = 1) -> None:
        """`unit`: `prompt_unit` of the run's topology; `period`: steps between evaluations (a fit step)."""
        self.period = period
        self.prompts = splittable(prompts, unit, f"--heldout_prompt_data {cfg.repulse.heldout_prompt_data}")
        self.cfg, self.out_dir, self.is_writer = cfg, out_dir, is_writer

    def __call__(self, trainer) -> dict[str, float]:
        from rlhf.distributed.collectives import all_gather_rollout

        cfg, rp = self.cfg, self.cfg.repulse
        rewards, returns, kls, rows = [], [], [], []
        for it in range(rp.sampling_iters):
            local = trainer.generate(trainer.samples_drawn, stream=10_000 + it, batch=self.prompts)
            batch = all_gather_rollout(local, trainer.tokenizer.pad_token_id)
            raw, old, ref = trainer.roles.experience.score(batch, with_ref=cfg.algo.needs_ref, rm_max_len=rp.rm_max_len)
            if ref is not None:
                ret, kl = repulse_losses.policy_returns_PK(raw, old, ref, batch.action_mask_BT1, cfg.algo.init_kl_coef)
            else:
                ret, kl = raw.float(), torch.zeros_like(raw)
            rewards.append(raw.float())
            returns.append(ret)
            kls.append(kl)
            rows += [{"prompt": p, "response": r, "reward": float(a), "return": float(b), "kl": float(c)}
                     for p, r, a, b, c in zip(batch.prompts, batch.responses, raw, ret, kl)]
        r, ret, kl = torch.cat(rewards), torch.cat(returns), torch.cat(kls)
        if self.is_writer:
            import json
            import os

            os.makedirs(self.out_dir, exist_ok=True)
            path = os.path.join(self.out_dir, f"heldout_{trainer.samples_drawn}.jsonl")
            with open(path, "w") as f:
                f.writelines(json.dumps(row) + "\n" for row in rows)
        return {"heldout_reward_mean": float(r.mean()), "heldout_return_mean": float(ret.mean()),
                "heldout_kl_mean": float(kl.mean()), "heldout_p_below": repulse_losses.prob_below(r, rp.threshold),
                "heldout_cvar": repulse_losses.cvar(r, rp.heldout_cvar_fraction)}


def the_single_prompt(cfg: TrainRepulseConfig, tokenizer) -> Prompt:
    """The one prompt of --new_custom_single_prompt / the analytic evaluation: --custom_prompt, else the only
    prompt of --prompt_data (which may repeat it)."""
    rp = cfg.repulse
    if rp.custom_prompt is not None:
        return single_prompt(cfg.data, rp.custom_prompt, tokenizer)
    prompts = load_prompts(cfg.data, tokenizer, seed=cfg.seed)
    texts = sorted({p.text for p in prompts})
    if len(texts) != 1:
        raise UsageError(f"--new_custom_single_prompt trains on one prompt, but --prompt_data {cfg.data.prompt_data} "
                         f"holds {len(texts)} different prompts (e.g. {texts[:2]}); give --custom_prompt TEXT or a "
                         "file of one prompt")
    return prompts[0]
