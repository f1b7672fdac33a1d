"""--async_save's copy of a checkpoint in host memory (`rlhf.utils.snapshot.host_copy`): independent of the live
state, pickled by torch.save byte for byte as the live state is (shared storages, repeated objects,
requires_grad, parameters), and what it holds counted."""

import io
from collections import OrderedDict, defaultdict

import torch

from rlhf.utils.snapshot import Snapshot, host_copy


def saved_bytes(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def test_the_copy_is_saved_as_the_live_state_and_does_not_follow_it():
    flat = torch.arange(12, dtype=torch.float32)
    master = flat[4:10].clone().requires_grad_(True)  # as a ZeRO optimizer's fp32 partition
    group = {"lr": 0.1, "params": [0, 1]}
    state = OrderedDict(
        weights=OrderedDict(a=flat[:4], b=flat[4:].view(2, 4)),  # two views of one storage
        master=[master], param=torch.nn.Parameter(torch.ones(2)),
        groups=[group, group],  # one object reached twice: pickled once, then by reference
        steps=defaultdict(int, {"actor": 3}), shapes=(torch.Size([2, 4]), "fp32"))
    storages = {}
    copied = host_copy(state, storages)
    assert saved_bytes(copied) == saved_bytes(state)
    assert copied["weights"]["b"].untyped_storage().data_ptr() == copied["weights"]["a"].untyped_storage().data_ptr()
    assert copied["groups"][0] is copied["groups"][1] and copied["groups"][0] is not group
    assert isinstance(copied["param"], torch.nn.Parameter) and copied["master"][0].requires_grad
    assert isinstance(copied["steps"], defaultdict) and copied["steps"].default_factory is int
    assert sum(s.nbytes() for s in storages.values()) == (12 + 6 + 2) * 4
    before = saved_bytes(state)
    with torch.no_grad():
        flat.add_(1), master.mul_(2), state["param"].zero_()
    group["lr"] = 0.2
    assert saved_bytes(copied) == before != saved_bytes(state)


def test_a_snapshot_writes_its_files_in_the_background_and_keeps_its_error(tmp_path):
    failures = []

    class Writing:  # stands in for CheckpointWriter.writing: records what failed
        def __init__(self, what):
            self.what = what

        def __enter__(self):
            return self

        def __exit__(self, kind, err, tb):
            if err is not None:
                failures.append(self.what)
            return False

    live = torch.zeros(3)
    snapshot = Snapshot(Writing)
    snapshot.save({"w": live}, str(tmp_path / "w.pt"), "the weights")
    snapshot.save_text('{"step": 1}', str(tmp_path / "state.json"))
    live.add_(5)
    assert not snapshot.done() and snapshot.bytes == 12  # nothing runs before start
    snapshot.start()
    snapshot.wait()
    assert snapshot.done() and snapshot.error is None and failures == []
    assert torch.equal(torch.load(tmp_path / "w.pt")["w"], torch.zeros(3))
    assert (tmp_path / "state.json").read_text() == '{"step": 1}'
    broken = Snapshot(Writing)
    broken.save({"w": live}, str(tmp_path / "missing" / "w.pt"), "the weights")
    broken.start()
    broken.wait()
    assert broken.done() and isinstance(broken.error, RuntimeError) and failures == ["the weights"]
