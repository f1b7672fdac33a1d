"""train_sft's bad inputs name the row and the fix."""

from __future__ import annotations

import json

import pytest

from rlhf.assets import EMBEDDED_MODEL_DIR
from tests.tiny_runs import CPU

SFT = [*CPU, "--train_batch_size", "16", "--micro_train_batch_size", "8", "--max_len", "32", "--max_epochs", "1",
       "--learning_rate", "3e-3", "--lr_warmup_ratio", "0.1", "--max_steps", "32", "--zero_stage", "2"]


def test_sft_bad_inputs_name_the_row_and_the_fix(tmp_path, capsys):
    from rlhf.cli.train_sft import main

    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"input": "a copy 1 :", "output": "1 1 1 1"}) + "\n"
                    + json.dumps({"input": "b copy 2 :", "answer": "2 2 2 2"}) + "\n")
    model = EMBEDDED_MODEL_DIR
    with pytest.raises(SystemExit) as exit_info:
        main([*SFT, "--pretrain", model, "--dataset", str(data), "--output_key", "output",
              "--save_path", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"{data}, row 2" in err and "'output'" in err, err
    with pytest.raises(SystemExit) as exit_info:
        main([*SFT, "--pretrain", model, "--save_path", str(tmp_path / "out2")])
    assert exit_info.value.code == 2
    assert f"--pretrain {model} is given but --dataset is not" in capsys.readouterr().err
