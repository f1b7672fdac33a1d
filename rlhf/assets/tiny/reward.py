"""Reward of the embedded demo: the fraction of the first four response words equal to the label."""

import torch


def reward_func(queries, prompts, labels):
    rewards = []
    for query, prompt, label in zip(queries, prompts, labels):
        words = query[len(prompt):].split()[:4]
        rewards.append(sum(w == str(label) for w in words) / 4.0)
    return torch.tensor(rewards, dtype=torch.float32)
