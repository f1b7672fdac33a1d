"""Test layers: pure CPU, multi-process gloo, end-to-end on the tiny model, and `gpu`-marked tests
that run only where CUDA is available."""

import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
