"""Checkpoint integrity without training: the manifest written at commit, verification and fallback to the
newest intact checkpoint (truncated file, bad JSON, missing rank state), the messages of a missing or empty
--ckpt_path, stale temporary directories, a full disk, RNG files that load with weights_only=True, and
metrics.jsonl on resume and on a re-run into the same --save_path."""

import json
import os
import pickle
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rlhf.config.errors import UsageError
from rlhf.utils import checkpoint_files as ckpt
from rlhf.utils.checkpoint_files import (
    MANIFEST,
    CheckpointWriteError,
    CheckpointWriter,
    complete_checkpoints,
    load_rank_state,
    pick_checkpoint,
    rng_state,
    verify_checkpoint,
    write_manifest,
)
from rlhf.utils.logging import MetricsLogger
from rlhf.utils.write_failure import write_failure_exit


def fake_checkpoint(root, step, world_size=2, manifest=True, identity=None):
    """A checkpoint as CheckpointWriter lays it out: trainer state, RNG files, a DeepSpeed-like shard."""
    d = root / f"global_step{step}"
    (d / "rng").mkdir(parents=True)
    (d / "actor" / "state").mkdir(parents=True)
    state = {"step": step, "world_size": world_size, **({"identity": identity} if identity else {})}
    (d / "trainer_state.json").write_text(json.dumps(state))
    for r in range(world_size):
        torch.save(rng_state(), d / "rng" / f"rank{r}.pt")
    (d / "actor" / "state" / "optim_states.pt").write_bytes(os.urandom(4096))
    if manifest:
        write_manifest(str(d))
    (d / "COMPLETE").write_text(f"{step}\n")
    return d


def pick(root, **kw):
    kw = {"resuming": True, "explicit_path": True, "restarted": False, **kw}
    return pick_checkpoint(str(root), **kw)


def test_manifest_records_sizes_and_small_file_checksums(tmp_path, monkeypatch):
    d = fake_checkpoint(tmp_path, 2)
    entries = json.loads((d / MANIFEST).read_text())["files"]
    assert sorted(entries) == ["actor/state/optim_states.pt", "rng/rank0.pt", "rng/rank1.pt", "trainer_state.json"]
    assert entries["actor/state/optim_states.pt"]["size"] == 4096
    assert all(e["crc32"] is not None for e in entries.values())
    assert verify_checkpoint(str(d)) is None
    monkeypatch.setattr(ckpt, "CHECKSUM_MAX_BYTES", 1024)  # large files: size only
    assert json.loads(json.dumps(write_manifest(str(d))))["files"]["actor/state/optim_states.pt"]["crc32"] is None


@pytest.mark.parametrize("damage, named, what", [
    (lambda d: (d / "rng" / "rank1.pt").write_bytes((d / "rng" / "rank1.pt").read_bytes()[:100]),
     "rng/rank1.pt", "has 100 bytes"),
    (lambda d: (d / "actor" / "state" / "optim_states.pt").unlink(), "optim_states.pt", "is missing"),
    (lambda d: (d / "trainer_state.json").write_text('{"step": 4, "world_size": 2'), "trainer_state.json",
     "has 27 bytes, MANIFEST.json says 28"),
    (lambda d: (d / MANIFEST).unlink(), MANIFEST, "is missing"),
])
def test_damaged_newest_checkpoint_falls_back_to_the_intact_one(tmp_path, damage, named, what):
    fake_checkpoint(tmp_path, 2)
    damage(fake_checkpoint(tmp_path, 4))
    done, path, notes = pick(tmp_path)
    assert (done, path) == (2, str(tmp_path / "global_step2"))
    [note] = notes
    assert note.startswith(f"checkpoint {tmp_path}/global_step4 is damaged, skipping it: ")
    assert named in note and what in note, note


def test_bad_json_and_missing_rank_state_written_into_the_manifest_are_caught(tmp_path):
    d = fake_checkpoint(tmp_path, 2, manifest=False)
    (d / "trainer_state.json").write_text('{"step": 2,')
    write_manifest(str(d))  # the manifest matches: the file was written bad
    assert verify_checkpoint(str(d)).startswith(f"{d}/trainer_state.json cannot be read")
    d = fake_checkpoint(tmp_path, 4, manifest=False)
    (d / "rng" / "rank1.pt").unlink()  # rank 1 never wrote its RNG state
    write_manifest(str(d))
    assert verify_checkpoint(str(d)) == f"{d}/rng/rank1.pt was never written (not in {MANIFEST})"


def test_no_intact_checkpoint_is_an_error_naming_each_bad_file(tmp_path):
    for step in (2, 4):
        d = fake_checkpoint(tmp_path, step)
        (d / "rng" / "rank0.pt").write_bytes(b"")
    with pytest.raises(ValueError) as err:
        pick(tmp_path)
    message = str(err.value)
    assert message.startswith(f"--load_checkpoint: no intact checkpoint under {tmp_path}:")
    for step in (2, 4):
        assert f"{tmp_path}/global_step{step}/rng/rank0.pt has 0 bytes" in message


def test_missing_or_empty_ckpt_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(UsageError, match=f"--load_checkpoint: --ckpt_path {missing} does not exist"):
        pick(missing)
    # the default path, a restarted job (its first attempt may have died before a checkpoint), an empty dir
    for path, kw in ((missing, {"explicit_path": False}), (missing, {"restarted": True}), (tmp_path, {})):
        done, chosen, notes = pick(path, **kw)
        assert (done, chosen) == (0, None)
        why = "torchrun restart" if kw.get("restarted") else "--load_checkpoint"
        assert notes == [f"{why}: no checkpoint under {path}, starting from step 0"]
    assert pick(missing, resuming=False) == (0, None, [])  # not resuming: nothing to say


def test_stale_temporary_directories_are_removed_at_start_and_prune(tmp_path):
    fake_checkpoint(tmp_path, 2)
    (tmp_path / ".tmp-global_step4" / "rng").mkdir(parents=True)
    done, _, notes = pick(tmp_path, resuming=False)
    assert notes == [f"removed {tmp_path}/.tmp-global_step4: a checkpoint whose writing was interrupted"]
    assert sorted(os.listdir(tmp_path)) == ["global_step2"]
    (tmp_path / ".tmp-global_step6").mkdir()
    ckpt.prune(str(tmp_path), max_num=3, max_gb=1.0)
    assert sorted(os.listdir(tmp_path)) == ["global_step2"]


def test_full_disk_is_reported_as_no_space_left_in_one_line(tmp_path, monkeypatch, capsys):
    writer = CheckpointWriter(str(tmp_path), 2, is_writer=True)
    (tmp_path / ".tmp-global_step2" / "rng").mkdir(parents=True)  # what begin() makes

    def full_disk(*args, **kwargs):  # what torch 2.13's torch.save raises when the disk fills up (seen on a tmpfs)
        try:
            raise RuntimeError("basic_ios::clear: iostream error")
        except RuntimeError:  # the zip writer's close fails too, while the first is handled: its context
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 128 vs 0")  # noqa: B904

    monkeypatch.setattr(torch, "save", full_disk)
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: SimpleNamespace(free=4096))
    with pytest.raises(CheckpointWriteError) as err:
        writer.save_rank_state(1)
    assert str(err.value).startswith(f"no space left on {tmp_path}/.tmp-global_step2 (0 MiB free) while writing "
                                     "rng/rank1.pt; the checkpoint was not completed")
    assert "basic_ios::clear" in str(err.value) and "its partial files are removed" in str(err.value)
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as ended, write_failure_exit():  # how the entry point ends the run
        raise err.value
    assert ended.value.code == 1
    assert capsys.readouterr().err == f"\n[rank 1] error: {err.value}\n"
    assert complete_checkpoints(str(tmp_path)) == [] and os.listdir(tmp_path) == []  # the space is given back
    (tmp_path / ".tmp-global_step2" / "rng").mkdir(parents=True)
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: SimpleNamespace(free=10 << 30))
    with pytest.raises(CheckpointWriteError, match=r"writing rng/rank1.pt into .* failed \(10240 MiB free\)"):
        writer.save_rank_state(1)
    (tmp_path / ".tmp-global_step2" / "rng").mkdir(parents=True)

    def parent_gone(*args, **kwargs):  # DeepSpeed's writer, after the rank that met the full disk removed the dir
        raise RuntimeError(f"Parent directory {tmp_path}/.tmp-global_step2/actor/state does not exist.")

    monkeypatch.setattr(torch, "save", parent_gone)
    for still_there in (True, False):  # caught while the other rank's removal is under way, or after it
        assert (tmp_path / ".tmp-global_step2").is_dir() == still_there  # the first failure removed it
        with pytest.raises(CheckpointWriteError, match=r"^writing rng/rank1.pt into .* failed: the unfinished "
                                                       "checkpoint's directory was removed by another rank whose "
                                                       r"write failed first \(its error line says why\)"):
            writer.save_rank_state(1)
    (tmp_path / ".tmp-global_step2" / "rng").mkdir(parents=True)

    def peer_gone(*args, **kwargs):  # another rank's view: the rank that met the full disk left the collective
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")

    monkeypatch.setattr(torch, "save", peer_gone)
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: SimpleNamespace(free=4096))
    with pytest.raises(CheckpointWriteError, match=r"^writing rng/rank1.pt into .* failed \(0 MiB free\): .*"
                                                   "Connection closed by peer"):
        writer.save_rank_state(1)


def test_rng_state_loads_with_weights_only_and_restores_every_generator(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.gauss(0, 1), np.random.normal()  # cached Gaussians are part of the state
    d = tmp_path / "global_step1"
    (d / "rng").mkdir(parents=True)
    torch.save(rng_state(), d / "rng" / "rank0.pt")
    expected = (random.random(), random.gauss(0, 1), np.random.rand(3).tolist(), np.random.normal(),
                torch.rand(3).tolist())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    torch.load(d / "rng" / "rank0.pt", weights_only=True)  # no pickled objects in it
    load_rank_state(str(d), 0)
    assert (random.random(), random.gauss(0, 1), np.random.rand(3).tolist(), np.random.normal(),
            torch.rand(3).tolist()) == expected


def test_rank_state_with_pickled_objects_is_refused_naming_the_file(tmp_path):
    d = tmp_path / "global_step1"
    (d / "rng").mkdir(parents=True)
    torch.save({"numpy": np.random.get_state()}, d / "rng" / "rank0.pt")  # the old format: numpy objects
    with pytest.raises(ValueError, match=f"{d}/rng/rank0.pt cannot be loaded"):
        load_rank_state(str(d), 0)
    with open(d / "rng" / "rank1.pt", "wb") as f:
        pickle.dump(os.system, f, protocol=2)
    with pytest.raises(ValueError, match="rank1.pt cannot be loaded"):
        load_rank_state(str(d), 1)


def write_rows(path, steps, partial=False):
    with open(path, "w") as f:
        f.writelines(json.dumps({"step": s, "reward_mean": s / 10}) + "\n" for s in steps)
        if partial:
            f.write('{"step": 5, "rew')  # cut by the crash


def test_metrics_on_resume_keep_rows_up_to_the_checkpoint(tmp_path):
    write_rows(tmp_path / "metrics.jsonl", [1, 2, 3, 4], partial=True)
    logger = MetricsLogger(str(tmp_path), None, 8, enabled=True)
    note = logger.continue_from(2, resuming=True)
    assert note == (f"{tmp_path}/metrics.jsonl: dropped 3 rows logged after step 2 by the interrupted run "
                    "(they are logged again)")
    logger.log(3, {"reward_mean": 0.3})
    logger.close()
    with open(tmp_path / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2, 3]
    assert MetricsLogger(str(tmp_path), None, 8, enabled=True).continue_from(3, resuming=True) is None


def test_rerun_into_the_same_save_path_is_refused(tmp_path):
    write_rows(tmp_path / "metrics.jsonl", [1, 2])
    with pytest.raises(UsageError, match=f"{tmp_path}/metrics.jsonl already holds 2 rows of metrics from an earlier "
                                         "run: pass --load_checkpoint to continue that run, or choose another "
                                         "--save_path"):
        MetricsLogger(str(tmp_path), None, 8, enabled=True).continue_from(0, resuming=False)
    assert MetricsLogger(str(tmp_path), None, 8, enabled=False).continue_from(0, resuming=False) is None
    (tmp_path / "metrics.jsonl").write_text("")
    assert MetricsLogger(str(tmp_path), None, 8, enabled=True).continue_from(0, resuming=False) is None


def test_a_checkpoint_that_cannot_be_resumed_is_refused_before_any_engine(tmp_path):
    """`check_resumable` (called with the output checks, before engines start) says what the resume would
    fail on later: no intact checkpoint, or one without engine states. Another number of ranks is no reason (the
    states move on load)."""
    from rlhf.utils.checkpoint_files import check_resumable

    check_resumable(str(tmp_path / "none"), why="--load_checkpoint")  # nothing yet: the run starts at 0
    fake_checkpoint(tmp_path, 2, world_size=2)
    check_resumable(str(tmp_path), why="--load_checkpoint")
    (tmp_path / "global_step2" / "rng" / "rank0.pt").write_bytes(b"")
    with pytest.raises(UsageError, match=rf"^torchrun restart: no intact checkpoint under {tmp_path}:\n  "
                                         rf"{tmp_path}/global_step2: .*rank0.pt has 0 bytes"):
        check_resumable(str(tmp_path), why="torchrun restart")
    assert (tmp_path / "global_step2").is_dir()  # read only: nothing removed


def test_a_resume_of_another_job_model_tokenizer_or_layout_is_refused_before_any_engine(tmp_path):
    """The checkpoint records its job, --pretrain's weights and tokenizer files, and the flags that shape its engine
    states (`rlhf.core.run.run_identity`): a resume by another job, from a model of the same shapes with other
    weights or another tokenizer, or with another dtype or LoRA is one line naming both and the fix
    (they used to train on silently, or fail 74 s in with DeepSpeed's AssertionError)."""
    import shutil

    from rlhf.assets import EMBEDDED_MODEL_DIR, EMBEDDED_REWARD_MODEL_DIR
    from rlhf.config.shared_config import EngineConfig, LoRAConfig
    from rlhf.core.run import run_identity
    from rlhf.utils.checkpoint_files import check_resumable

    def ppo_config(pretrain, zero_stage=2, param_dtype="fp32", lora_rank=0, tp=1):  # what run_identity reads
        model = SimpleNamespace(pretrain=pretrain, param_dtype=param_dtype, lora=LoRAConfig(lora_rank=lora_rank))
        engine = EngineConfig(zero_stage=zero_stage, ds_tensor_parallel_size=tp)
        return type("TrainPPOConfig", (), {"model": model, "engine": engine})()

    ppo = run_identity(ppo_config(EMBEDDED_MODEL_DIR))
    assert ppo["job"] == "train_ppo" and len(ppo["pretrain_fingerprint"]) == 64
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(ppo["tokenizer_fingerprint"])
    # --zero_stage and --ds_tensor_parallel_size may change: the states move
    assert ppo["state_flags"] == {"--param_dtype": "fp32", "--lora_rank": 0}
    ckpt = tmp_path / "ckpt"
    fake_checkpoint(ckpt, 4, world_size=1, identity=ppo)
    check_resumable(str(ckpt), why="--load_checkpoint", identity=ppo)  # the same run: resumes
    check_resumable(str(ckpt), why="--load_checkpoint", identity=None)  # a caller that records nothing
    old = {key: value for key, value in ppo.items() if key in ("job", "pretrain", "pretrain_fingerprint")}
    fake_checkpoint(tmp_path / "older", 4, world_size=1, identity=old)  # an older version's record: resumes
    check_resumable(str(tmp_path / "older"), why="--load_checkpoint", identity=ppo)
    with pytest.raises(UsageError, match=r"^--load_checkpoint: checkpoint .*global_step4 was written by the "
                                         r"'train_ppo' job and this is the 'train_sft' job: resume it with the job "
                                         r"that wrote it"):
        check_resumable(str(ckpt), why="--load_checkpoint", identity={**ppo, "job": "train_sft"})
    other = run_identity(ppo_config(EMBEDDED_REWARD_MODEL_DIR))  # same architecture, other weights
    with pytest.raises(UsageError, match=rf"continues a run of --pretrain {EMBEDDED_MODEL_DIR} and this run's "
                                         rf"--pretrain {EMBEDDED_REWARD_MODEL_DIR} holds other weights .*pass the "
                                         "run's --pretrain, or start a new --ckpt_path"):
        check_resumable(str(ckpt), why="--load_checkpoint", identity=other)
    retokenized = tmp_path / "retokenized"  # the same weights, one token added to the tokenizer's config
    shutil.copytree(EMBEDDED_MODEL_DIR, retokenized)
    config = json.loads((retokenized / "tokenizer_config.json").read_text())
    config["additional_special_tokens"] = ["<tool>"]
    (retokenized / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(UsageError, match=rf"this run's --pretrain {retokenized} has another tokenizer "
                                         r"\(tokenizer_config.json differ: its token ids mean other text\): pass the "
                                         "run's --pretrain"):
        check_resumable(str(ckpt), why="--load_checkpoint", identity=run_identity(ppo_config(str(retokenized))))
    check_resumable(str(ckpt), why="--load_checkpoint", identity=run_identity(ppo_config(EMBEDDED_MODEL_DIR, 3)))
    relora = run_identity(ppo_config(EMBEDDED_MODEL_DIR, zero_stage=3, param_dtype="bf16", lora_rank=8))
    with pytest.raises(UsageError, match=r"was written with --param_dtype fp32, --lora_rank 0 and this run has "
                                         r"--param_dtype bf16, --lora_rank 8 \(its engine states .*\): resume with "
                                         "--param_dtype fp32, --lora_rank 0, or start a new --ckpt_path"):
        check_resumable(str(ckpt), why="--load_checkpoint", identity=relora)
    # another tensor-parallel size: the states move (tests/dist/test_portable_state.py)
    check_resumable(str(ckpt), why="--load_checkpoint", identity=run_identity(ppo_config(EMBEDDED_MODEL_DIR, tp=2)))
