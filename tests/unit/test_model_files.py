"""Damaged model directories are refused before any engine starts, one line per problem: a truncated
model.safetensors, a broken config.json, no weights, a sharded index naming a missing shard."""

import shutil

import pytest

from rlhf.assets import EMBEDDED_MODEL_DIR
from rlhf.config.errors import UsageError
from rlhf.models.loading import check_local_model
from rlhf.models.model_files import model_file_problems


@pytest.fixture
def model_copy(tmp_path):
    copy = tmp_path / "policy"
    shutil.copytree(EMBEDDED_MODEL_DIR, copy)
    return copy


def test_an_intact_copy_passes(model_copy):
    assert model_file_problems(str(model_copy)) == []
    check_local_model(str(model_copy), "--pretrain")


def test_each_damage_is_named_with_its_file(model_copy):
    weights = model_copy / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size - 100)
    (model_copy / "config.json").write_text('{"model_type": "llama",\n  "hidden_size": }')
    problems = model_file_problems(str(model_copy))
    assert problems == [f"{model_copy}/config.json: not valid JSON (line 2, column 18: Expecting value)",
                        f"{weights}: truncated: its tensors need {size} bytes, the file has {size - 100}"]
    with pytest.raises(UsageError) as err:
        check_local_model(str(model_copy), "--reward_pretrain")
    assert str(err.value).splitlines() == [f"--reward_pretrain {model_copy} cannot be loaded:",
                                           *(f"  {p}" for p in problems)]


def test_missing_weights_and_shards(model_copy):
    (model_copy / "model.safetensors").unlink()
    assert model_file_problems(str(model_copy)) == [
        f"{model_copy}: no weight files (model.safetensors, pytorch_model.bin or a sharded index)"]
    (model_copy / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}')
    assert model_file_problems(str(model_copy))[0] == (
        f"{model_copy}/model.safetensors.index.json names 2 shard(s) that are missing: "
        "model-00001-of-00002.safetensors, model-00002-of-00002.safetensors")


def test_a_header_longer_than_the_file(model_copy):
    import struct

    weights = model_copy / "model.safetensors"
    (header_bytes,) = struct.unpack("<Q", weights.read_bytes()[:8])
    with open(weights, "r+b") as f:
        f.truncate(20)
    assert model_file_problems(str(model_copy)) == [
        f"{weights}: its header claims {header_bytes} bytes but the file has 20 (truncated?)"]
