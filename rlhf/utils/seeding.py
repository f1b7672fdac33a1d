"""Seeding of every random stream the trainer uses."""

from __future__ import annotations

import os
import random

import numpy as np
import torch


def seed_everything(seed: int, full_determinism: bool = False) -> None:
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)
    if full_determinism:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
