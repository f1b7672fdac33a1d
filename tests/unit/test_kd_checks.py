"""train_kd refuses a teacher with another vocabulary, and a missing teacher, before any engine starts."""

from __future__ import annotations

import pytest

from tests.tiny_runs import CPU

BASE = [*CPU, "--train_batch_size", "16", "--micro_train_batch_size", "8", "--max_len", "32", "--max_epochs", "1",
        "--learning_rate", "3e-3", "--lr_warmup_ratio", "0.1", "--zero_stage", "2"]


def test_a_teacher_with_another_vocabulary_is_refused(tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf.cli.train_kd import main

    other = tmp_path / "other"
    LlamaForCausalLM(LlamaConfig(vocab_size=80, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(other)
    with pytest.raises(SystemExit) as exit_info:
        main([*BASE, "--teacher_model", str(other), "--save_path", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert f"vocab_size 80 (--teacher_model {other}) vs 64" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*BASE, "--save_path", str(tmp_path / "out2")])
    assert "--teacher_model is required" in capsys.readouterr().err
