"""A model directory without its tokenizer files: one line naming the directory and the files it lacks, not
transformers' advice to install sentencepiece or tiktoken; a damaged tokenizer file: one line naming it."""

from __future__ import annotations

import shutil

import pytest

from rlhf.assets import EMBEDDED_MODEL_DIR
from rlhf.config.errors import UsageError
from rlhf.models.loading import load_tokenizer, read_tokenizer


def _model_without_tokenizer(path, keep_config: bool):
    path.mkdir()
    for name in ("config.json", "model.safetensors") + (("tokenizer_config.json",) if keep_config else ()):
        shutil.copy(f"{EMBEDDED_MODEL_DIR}/{name}", path / name)
    return str(path)


def test_missing_tokenizer_files_are_named_with_their_directory(tmp_path):
    bare = _model_without_tokenizer(tmp_path / "bare", keep_config=False)
    with pytest.raises(UsageError) as info:
        load_tokenizer(bare)
    assert str(info.value) == (
        f"--pretrain {bare}: this directory holds no tokenizer files (none of tokenizer.json, tokenizer.model, "
        f"vocab.json + merges.txt; no tokenizer_config.json either); copy the tokenizer files of the model it was "
        f"made from into {bare}")
    configured = _model_without_tokenizer(tmp_path / "configured", keep_config=True)
    with pytest.raises(UsageError) as info:
        read_tokenizer(configured, flag="--model_path")
    assert str(info.value).startswith(f"--model_path {configured}: this directory holds no tokenizer files (none of "
                                      "tokenizer.json, tokenizer.model, vocab.json + merges.txt); copy")


def test_a_broken_tokenizer_file_keeps_transformers_error(tmp_path):
    broken = _model_without_tokenizer(tmp_path / "broken", keep_config=True)
    (tmp_path / "broken" / "tokenizer.json").write_text("{}")
    with pytest.raises(Exception) as info:
        load_tokenizer(broken)
    assert not isinstance(info.value, UsageError)


def test_a_damaged_tokenizer_file_is_named_with_where_it_breaks(tmp_path):
    """A tokenizer.json cut short (a full disk, a broken copy) is one line naming the file (it was a bare
    `JSONDecodeError: Expecting ',' delimiter`)."""
    damaged = tmp_path / "damaged"
    shutil.copytree(EMBEDDED_MODEL_DIR, damaged)
    text = (damaged / "tokenizer.json").read_text()
    (damaged / "tokenizer.json").write_text(text[: len(text) // 2])
    with pytest.raises(UsageError, match=rf"^--reward_pretrain {damaged}: tokenizer.json is damaged \(line \d+ "
                                         r"column \d+: .+\); copy it again from the model it came from$"):
        load_tokenizer(str(damaged), flag="--reward_pretrain")


def test_train_sft_exits_2_with_one_line(tmp_path, capsys):
    from rlhf.assets import EMBEDDED_SFT
    from rlhf.cli.train_sft import main

    bare = _model_without_tokenizer(tmp_path / "bare", keep_config=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["--pretrain", bare, "--dataset", EMBEDDED_SFT, "--max_len", "64", "--save_path", str(tmp_path / "out"),
              "--attn_implementation", "sdpa"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"error: --pretrain {bare}: this directory holds no tokenizer files"), err
