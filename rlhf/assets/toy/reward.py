"""Reward of the RePULSe toy: 2-word responses; a response with a bad word (x, y or z) scores -5, any other
scores the fraction of its two words that are digits (0, 0.5 or 1)."""

import torch

BAD_WORDS = ("x", "y", "z")
DIGITS = tuple("0123456789")


def reward_func(queries, prompts, labels):
    rewards = []
    for query, prompt in zip(queries, prompts):
        words = query[len(prompt):].split()[:2]
        if any(w in BAD_WORDS for w in words):
            rewards.append(-5.0)
        else:
            rewards.append(sum(w in DIGITS for w in words) / 2.0)
    return torch.tensor(rewards, dtype=torch.float32)
