"""Pruning keeps the newest complete checkpoints within the count (max_num) and size (max_gb) limits."""



from rlhf.utils.checkpoint_files import complete_checkpoints, prune


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
