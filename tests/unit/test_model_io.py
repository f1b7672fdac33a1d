"""The value head is read by key from the one shard (or single file) that holds it."""

import json
import os

import pytest
import safetensors.torch
import torch
from safetensors.torch import save_file

import rlhf.models.value as value

HEAD = "score.weight"


@pytest.fixture
def reads(monkeypatch):
    """Which (shard, key) pairs `_head_weight` reads; loading a whole shard fails the test."""
    def whole_shard(*args, **kwargs):
        raise AssertionError("a whole shard was loaded")

    monkeypatch.setattr(safetensors.torch, "load_file", whole_shard)
    monkeypatch.setattr(value, "load_file", whole_shard, raising=False)
    log: list[tuple[str, str]] = []
    real_open = safetensors.safe_open

    class Spy:
        def __init__(self, filename, framework):
            self.name, self.inner = os.path.basename(filename), real_open(filename, framework=framework)

        def __enter__(self):
            self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, key):
            log.append((self.name, key))
            return self.inner.get_tensor(key)

    monkeypatch.setattr(value, "safe_open", Spy, raising=False)
    return log


def _tensors(seed: int, *names: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(2, 4, generator=g) for n in names}


def test_head_weight_reads_one_key_from_the_indexed_shard(tmp_path, reads):
    first, second = _tensors(0, "model.embed.weight", "model.norm.weight"), _tensors(1, "model.layer.weight", HEAD)
    save_file(first, tmp_path / "model-00001-of-00002.safetensors")
    save_file(second, tmp_path / "model-00002-of-00002.safetensors")
    weight_map = {**{k: "model-00001-of-00002.safetensors" for k in first},
                  **{k: "model-00002-of-00002.safetensors" for k in second}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert torch.equal(value._head_weight(str(tmp_path), HEAD), second[HEAD])
    assert reads == [("model-00002-of-00002.safetensors", HEAD)]
    reads.clear()
    assert value._head_weight(str(tmp_path), "missing.weight") is None
    assert reads == []


def test_head_weight_reads_one_key_from_a_single_file(tmp_path, reads):
    tensors = _tensors(2, "model.embed.weight", HEAD, "model.norm.weight")
    save_file(tensors, tmp_path / "model.safetensors")
    assert torch.equal(value._head_weight(str(tmp_path), HEAD), tensors[HEAD])
    assert value._head_weight(str(tmp_path), "missing.weight") is None
    assert reads == [("model.safetensors", HEAD)]
