"""The restartable output of batch inference: a JSON Lines file written in chunks, a small progress record
next to it, and the chunk loop that resumes after the last chunk that reached the disk.

After each chunk the writer appends the chunk's rows, fsyncs the file, then replaces the progress record
(`<file>.progress.json`, written to a temporary file, fsynced and renamed over the old one) with the new
row count, byte length and SHA-256 of the file. A run interrupted anywhere (even mid-line) restarts from
the last recorded chunk: the file is cut back to the recorded length first, so no row is torn or written
twice; rows are a pure function of the inputs and the seed, so the finished file equals an uninterrupted
run's. The record also holds a fingerprint of the run's settings and input files: a run with other inputs
starts the file afresh (as OpenRLHF overwrites its output). This module knows nothing of models or ranks
beyond "rank 0 writes".
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from rlhf.config.errors import UsageError

PROGRESS_SUFFIX = ".progress.json"


def progress_path(path: str) -> str:
    """Where the progress record of output file `path` lives."""
    return path + PROGRESS_SUFFIX


@dataclass(frozen=True)
class Progress:
    """What has durably reached the output file: `chunks_done` of `num_chunks` chunks, `num_rows` rows in
    `num_bytes` bytes whose SHA-256 is `sha256`; `complete` once the run's final output is in place."""

    fingerprint: str
    num_chunks: int
    chunks_done: int = 0
    num_rows: int = 0
    num_bytes: int = 0
    sha256: str = hashlib.sha256().hexdigest()
    complete: bool = False


def file_stamps(paths: Iterable[str], exclude: Sequence[str] = ()) -> list[tuple[str, int, int]]:
    """(path, size, mtime in ns) of each existing file, and of every file under each existing directory; a
    `name@dir` dataset source stands for both parts. Files whose absolute path starts with one of `exclude`
    are left out (a run's own output may sit inside its model or data directory). Reads metadata only."""
    stamps = []
    for path in paths:
        candidates = [path] if os.path.exists(path) else [p for p in path.split("@") if p and os.path.exists(p)]
        for candidate in candidates:
            files = [candidate] if os.path.isfile(candidate) else sorted(
                os.path.join(root, name) for root, _, names in os.walk(candidate) for name in names)
            for file in map(os.path.abspath, files):
                if not any(file.startswith(prefix) for prefix in exclude):
                    st = os.stat(file)
                    stamps.append((file, st.st_size, st.st_mtime_ns))
    return stamps


def fingerprint(settings: Any, input_paths: Iterable[str], exclude: Sequence[str] = ()) -> str:
    """A digest of `settings` (a dataclass or JSON-able value) and the stamps of the input files (see
    `file_stamps`): equal digests mean a rerun would write the same rows."""
    if dataclasses.is_dataclass(settings):
        settings = dataclasses.asdict(settings)
    blob = json.dumps({"settings": settings, "inputs": file_stamps(input_paths, exclude)}, sort_keys=True,
                      default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _fsync_dir(path: str) -> None:
    fd = os.open(os.path.dirname(os.path.abspath(path)) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: str, text: str) -> None:
    """Replace `path` with `text`: written to a temporary file, fsynced, renamed over `path`, directory fsynced.
    A reader sees the old content or the new one, never a mix."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path)


def _prefix_digest(path: str, num_bytes: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        left = num_bytes
        while left:
            block = f.read(min(left, 1 << 20))
            if not block:
                break
            digest.update(block)
            left -= len(block)
    return digest.hexdigest()


class ChunkedJsonlWriter:
    """The JSON Lines file `path` and its progress record. Only the writing rank (rank 0) constructs one."""

    def __init__(self, path: str, fingerprint: str, num_chunks: int, record_path: str | None = None) -> None:
        """`record_path`: where the progress record lives (default: `progress_path(path)`)."""
        self.path, self.record_path = path, record_path or progress_path(path)
        self.progress = Progress(fingerprint, num_chunks)
        self._digest = hashlib.sha256()

    def read_progress(self) -> Progress | None:
        """The recorded progress of an earlier run with the same fingerprint and chunking, else None."""
        if not os.path.isfile(self.record_path):
            return None
        with open(self.record_path, encoding="utf-8") as f:
            try:
                recorded = Progress(**json.load(f))
            except (json.JSONDecodeError, TypeError) as err:
                raise UsageError(f"{self.record_path} is not a progress record ({err}); delete it to start "
                                 f"{self.path} afresh") from err
        same = (recorded.fingerprint, recorded.num_chunks) == (self.progress.fingerprint, self.progress.num_chunks)
        return recorded if same else None

    def resume(self) -> Progress:
        """Line the file up with the recorded progress and return it (chunks done: 0 for a fresh start). An
        earlier run with the same inputs resumes after its last recorded chunk (a tail written after it, torn or
        not, is cut off); otherwise, or when the file is gone, it is started afresh. A file shorter than its
        record, or whose recorded part changed, was edited since: a UsageError."""
        recorded = self.read_progress()
        if recorded is None or not os.path.isfile(self.path):
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            with open(self.path, "wb") as f:
                os.fsync(f.fileno())
            self._record(self.progress)
            return self.progress
        size = os.path.getsize(self.path)
        if size < recorded.num_bytes or _prefix_digest(self.path, recorded.num_bytes) != recorded.sha256:
            raise UsageError(f"{self.path} no longer holds the {recorded.num_rows} rows its progress record "
                             f"{self.record_path} lists (changed after the interrupted run?): delete both files to "
                             "start afresh")
        if size > recorded.num_bytes:
            with open(self.path, "r+b") as f:
                f.truncate(recorded.num_bytes)
                os.fsync(f.fileno())
        self._digest = hashlib.sha256()
        with open(self.path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                self._digest.update(block)
        self.progress = recorded
        return recorded

    def append_chunk(self, rows: list[dict]) -> Progress:
        """Append one chunk's rows durably, then record them."""
        data = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode("utf-8")
        with open(self.path, "ab") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        self._digest.update(data)
        p = self.progress
        self._record(dataclasses.replace(p, chunks_done=p.chunks_done + 1, num_rows=p.num_rows + len(rows),
                                         num_bytes=p.num_bytes + len(data), sha256=self._digest.hexdigest()))
        return self.progress

    def mark_complete(self) -> None:
        """Record that the run's final output is in place (a rerun with the same inputs then does nothing)."""
        self._record(dataclasses.replace(self.progress, complete=True))

    def rows(self) -> list[dict]:
        """Every row written so far."""
        with open(self.path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]

    def _record(self, progress: Progress) -> None:
        write_atomically(self.record_path, json.dumps(dataclasses.asdict(progress), indent=1) + "\n")
        self.progress = progress


def num_chunks(num_items: int, chunk_size: int) -> int:
    return -(-num_items // chunk_size)


def run_chunks(writer: ChunkedJsonlWriter | None, num_items: int, chunk_size: int,
               compute: Callable[[range], list[dict]], should_stop: Callable[[], bool],
               group: dist.ProcessGroup | None, on_chunk: Callable[[int], None] = lambda n: None) -> bool:
    """Process items [0, num_items) in chunks of `chunk_size`, from the first chunk not yet recorded: for each
    chunk `compute(items)` (collective; its rows on rank 0, ignored elsewhere), rank 0 appends them, and
    `on_chunk(items done)` reports progress. After each chunk `should_stop()` (collective) may end the run
    early. Returns whether every chunk is done. Every rank of `group` (the world) calls it; only global rank 0
    passes a `writer`, which it has already `resume`d."""
    start = [writer.progress.chunks_done if writer is not None else 0]
    dist.broadcast_object_list(start, src=0, group=group)
    total = num_chunks(num_items, chunk_size)
    for chunk in range(start[0], total):
        items = range(chunk * chunk_size, min((chunk + 1) * chunk_size, num_items))
        rows = compute(items)
        if writer is not None:
            writer.append_chunk(rows)
        on_chunk(items.stop)
        if chunk + 1 < total and should_stop():
            return False
    return True


def split_range(items: range, num_parts: int, index: int) -> range:
    """Contiguous part `index` of `items` cut into `num_parts` parts whose sizes differ by at most one (the
    first parts are the larger)."""
    base, extra = divmod(len(items), num_parts)
    start = items.start + index * base + min(index, extra)
    return range(start, start + base + (index < extra))


def gather_to_first(rows: list[dict], group: dist.ProcessGroup | None) -> list[dict]:
    """Every rank's `rows` concatenated in rank order on global rank 0 ([] on the other ranks). Collective:
    every rank of `group` calls it; rank 0 must belong to it."""
    parts: list | None = [None] * dist.get_world_size(group) if dist.get_rank() == 0 else None
    dist.gather_object(rows, parts, dst=0, group=group)
    return [row for part in parts for row in part] if parts is not None else []
