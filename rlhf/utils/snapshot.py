"""A checkpoint written in the background (--async_save): this rank's part captured as a copy in host memory at the
step's end, written to its files by a thread while the next steps run.

`Snapshot` collects what the rank would have written (`save`: torch.save's object and path; `save_text`; DeepSpeed's
own writes through `capturing`, which stands in for the engine's checkpoint engine), each as a copy, then `start`s a
thread that writes the files in the order they came. Its error, if any, is kept for the trainer to raise
(`rlhf.core.checkpointer.Checkpointer.settle`), which also decides, with the other ranks, when the checkpoint is
complete. The copy keeps what torch.save would have kept: tensors that shared a storage share one copy of it (the
file holds the same bytes as a direct save), and everything else is deep-copied, so the live state may change as
soon as `save` returns.
"""

from __future__ import annotations

import contextlib
import copy
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

WRITER_NICENESS = 10
"""The writing thread's nice value (Linux: per thread): where every core is busy, the rank's own work goes first
and the writing takes what is left."""


def host_copy(obj: Any, storages: dict | None = None) -> Any:
    """`obj` with every tensor copied into host memory (tensors sharing a storage share its one copy, at the
    same offsets), containers rebuilt and any other object deep-copied; an object reached twice is copied once,
    so the copy pickles as the original does. `storages` (filled in): the host copies, by device storage."""
    storages = {} if storages is None else storages
    return _copy(obj, {}, storages)


def _copy(obj: Any, memo: dict, storages: dict) -> Any:
    key = id(obj)
    if key in memo:
        return memo[key]
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        where = (obj.device, storage.data_ptr(), storage.nbytes())
        host = storages.get(where)
        if host is None:
            host = storages[where] = storage.cpu() if obj.device.type != "cpu" else storage.clone()
        copied: Any = torch.empty(0, dtype=obj.dtype).set_(host, obj.storage_offset(), obj.size(), obj.stride())
        if isinstance(obj, torch.nn.Parameter):
            copied = torch.nn.Parameter(copied, requires_grad=obj.requires_grad)
        elif obj.requires_grad:  # saved with the tensor (a ZeRO optimizer's fp32 partitions)
            copied.requires_grad_(True)
    elif isinstance(obj, dict):
        copied = memo[key] = copy.copy(obj)  # the same mapping type (OrderedDict, defaultdict) with its attributes
        copied.clear()
        copied.update((k, _copy(v, memo, storages)) for k, v in obj.items())
    elif isinstance(obj, list):
        copied = memo[key] = []
        copied.extend(_copy(v, memo, storages) for v in obj)
    elif type(obj) is tuple:
        copied = tuple(_copy(v, memo, storages) for v in obj)
    else:
        copied = copy.deepcopy(obj, memo)
    memo[key] = copied
    return copied


class Snapshot:
    """This rank's part of one checkpoint, captured now and written by a background thread (`start`).
    `writing(what)`: the context that turns a failed write into the checkpoint's one-line error
    (`rlhf.utils.checkpoint_files.CheckpointWriter.writing`)."""

    def __init__(self, writing: Callable[[str], contextlib.AbstractContextManager]) -> None:
        self._writing = writing
        self._files: list[tuple[str, Callable[[], None]]] = []  # (what, write)
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.bytes = 0  # host memory the copies hold

    def save(self, obj: Any, path: str, what: str | None = None, **torch_save_kwargs: Any) -> None:
        """torch.save(obj, path, **torch_save_kwargs), from a copy taken now."""
        storages: dict = {}
        copied = host_copy(obj, storages)
        self.bytes += sum(s.nbytes() for s in storages.values())
        self._files.append((what or path, lambda: torch.save(copied, path, **torch_save_kwargs)))

    def save_text(self, text: str, path: str, what: str | None = None) -> None:
        def write() -> None:
            with open(path, "w") as f:
                f.write(text)

        self._files.append((what or path, write))

    @contextlib.contextmanager
    def capturing(self, engine: Any, what: str) -> Iterator[None]:
        """Inside: the DeepSpeed `engine`'s checkpoint writes (save_checkpoint's files) go into this snapshot,
        with the serialization its own checkpoint engine would use, a failed one named as `what`; directories
        are still made at once."""
        from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

        real = engine.checkpoint_engine
        kwargs = {}
        if hasattr(real, "zipfile_serialization"):  # DeepSpeed's torch engine: its configured format
            kwargs["_use_new_zipfile_serialization"] = real.zipfile_serialization
        snapshot = self

        class Capturing(CheckpointEngine):
            def create(self, info: Any) -> None:
                pass

            def save(self, state_dict: Any, path: str) -> None:
                snapshot.save(state_dict, path, what, **kwargs)

            def load(self, path: str, map_location: Any = None) -> Any:
                return real.load(path, map_location=map_location)

            def commit(self, info: Any) -> bool:
                return True

        engine.checkpoint_engine = Capturing()
        try:
            yield
        finally:
            engine.checkpoint_engine = real

    def start(self) -> None:
        """Write the captured files in a background thread (a daemon: a process that ends abnormally does not wait
        for it, and its checkpoint stays incomplete)."""
        self._thread = threading.Thread(target=self._write, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def _write(self) -> None:
        with contextlib.suppress(OSError):  # the step's thread first where the cores are all busy
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICENESS)
        try:
            for what, write in self._files:
                with self._writing(what):
                    write()
        except BaseException as err:  # noqa: BLE001 -- kept for the trainer's thread to raise
            self.error = err
        finally:
            self._files = []  # the copies are freed as soon as they are written

    def done(self) -> bool:
        """Whether every file is written (or the writing failed)."""
        return self._thread is not None and not self._thread.is_alive()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
