"""Dataset sources: read the rows named by an OpenRLHF `--dataset` value (local files only) and mix them.

A value is comma-separated sources, each one of: a JSON/JSONL file, a parquet file, a directory of
either (files named for the split first), a `datasets` `save_to_disk` directory, or `json@DIR` /
`parquet@DIR`. Sources are capped at `max_samples` rows each, then concatenated or, with
`--dataset_probs`, interleaved exactly as OpenRLHF's `blending_datasets` does (HF `interleave_datasets`,
`stopping_strategy="all_exhausted"`), then capped at `max_samples` rows in all. Nothing here downloads,
formats or tokenizes: rows come back as plain dicts with their file and row number for error messages.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from rlhf.config.errors import UsageError

DATA_EXTENSIONS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
_SPLIT_NAMES = ("train", "test", "validation", "valid", "val", "dev", "eval")


@dataclass(frozen=True)
class Row:
    """One dataset row: the file (or `save_to_disk` directory) it came from, its 1-based number there,
    and its columns."""

    source: str
    number: int
    data: dict[str, Any]

    @property
    def where(self) -> str:
        """`FILE, row N`, the location every data error names."""
        return f"{self.source}, row {self.number}"


# --- JSON -----------------------------------------------------------------------------------------


def _json_lines(path: str, lines) -> list:
    rows = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}, line {lineno}: not valid JSON ({err.msg})") from err
    return rows


def _utf8_text(path: str) -> str:
    """The text of the file at `path`, decoded as UTF-8. Bytes that are not UTF-8 are a UsageError naming the
    file, the line and the byte offset of the first bad one (Python's UnicodeDecodeError names neither the file
    nor the line, and every rank would print it)."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise UsageError(f"{path}, line {line}: not UTF-8 text (byte 0x{data[err.start]:02x} at byte offset "
                         f"{err.start}: {err.reason}); re-encode the file as UTF-8 from the encoding it was "
                         f"written in (e.g. `iconv -f latin1 -t utf-8 {path}`)") from err


def read_json_file(path: str) -> list:
    """The rows of a `.jsonl` file (one JSON value a line) or a `.json` file (a list, or an object whose
    "data" member is the list). Bad JSON is a ValueError naming the file and line; bytes that are not UTF-8
    a UsageError naming the file, line and byte offset (`_utf8_text`)."""
    text = _utf8_text(path)
    if path.endswith(".jsonl"):
        return _json_lines(path, text.split("\n"))
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})") from err
    if isinstance(data, dict) and "data" in data:
        data = data["data"]
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of objects (or JSONL, one object per line)")
    return data


def _read_json_rows(path: str) -> list:
    """As `read_json_file`, and a `.json` file holding JSON Lines is read as such (HF's json loader
    accepts both, and many datasets ship that way)."""
    try:
        return read_json_file(path)
    except ValueError as err:
        cause = err.__cause__
        if not (path.endswith(".json") and isinstance(cause, json.JSONDecodeError) and cause.msg == "Extra data"):
            raise
    return _json_lines(path, _utf8_text(path).split("\n"))


def _read_parquet_rows(path: str) -> list:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except Exception as err:  # pyarrow raises several types for a damaged file
        raise ValueError(f"{path}: not a readable parquet file ({err})") from err


_READERS = {"json": _read_json_rows, "parquet": _read_parquet_rows}


# --- one source -----------------------------------------------------------------------------------


def _is_saved_dataset(path: str) -> bool:
    has = lambda name: os.path.isfile(os.path.join(path, name))  # noqa: E731
    return has("dataset_dict.json") or (has("state.json") and has("dataset_info.json"))


def _data_files(path: str, kind: str | None) -> list[tuple[str, str]]:
    """(relative path, kind) of every JSON/parquet file under `path`, sorted."""
    found = []
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            file_kind = DATA_EXTENSIONS.get(os.path.splitext(name)[1].lower())
            if file_kind and (kind is None or file_kind == kind):
                found.append((os.path.relpath(os.path.join(root, name), path), file_kind))
    return sorted(found)


def _names_split(relpath: str, split: str) -> bool:
    """True when a file is named for `split`: its name starts with it, or a folder on its path is it."""
    parts = relpath.split(os.sep)
    return parts[-1].startswith(split) or split in parts[:-1]


def _split_files(path: str, kind: str | None, split: str, where: str) -> list[tuple[str, str]]:
    files = _data_files(path, kind)
    wanted = {"json": "JSON/JSONL", "parquet": "parquet", None: "JSON/JSONL or parquet"}[kind]
    if not files:
        raise ValueError(f"{where}: directory has no {wanted} files")
    chosen = [f for f in files if _names_split(f[0], split)]
    if not chosen:
        other = [f[0] for f in files if any(_names_split(f[0], s) for s in _SPLIT_NAMES if s != split)]
        if other:
            raise ValueError(f"{where}: no files for split {split!r} (files are named for other splits: "
                             f"{', '.join(other[:5])}); choose one of those splits or name the files")
        chosen = files
    kinds = {k for _, k in chosen}
    if len(kinds) > 1:
        raise ValueError(f"{where}: directory holds both JSON and parquet files; pick one kind with "
                         f"json@{path} or parquet@{path}")
    return [(os.path.join(path, rel), k) for rel, k in chosen]


def _saved_dataset_rows(path: str, split: str, cap: int, where: str) -> list[Row]:
    from datasets import DatasetDict, load_from_disk

    data = load_from_disk(path)
    source = path
    if isinstance(data, DatasetDict):
        if split not in data:
            raise ValueError(f"{where}: saved dataset has no split {split!r} (splits: {', '.join(data)}); "
                             "choose one of those")
        data, source = data[split], f"{path} [{split}]"
    data = data.select(range(min(cap, len(data))))
    return [Row(source, i, row) for i, row in enumerate(data.to_list(), 1)]


def _locate(source: str, flag: str) -> tuple[str, str | None]:
    """(path, kind forced by a `json@`/`parquet@` prefix or None) of one source, or a ValueError."""
    if os.path.exists(source):
        return source, None
    name, _, data_dir = source.partition("@")
    if data_dir and name in _READERS:
        if not os.path.isdir(data_dir):
            raise ValueError(f"{flag} {source}: {data_dir} is not a directory ({name}@DIR reads the "
                             f"{name} files of a local directory)")
        return data_dir, name
    if data_dir and os.path.isdir(name):  # OpenRLHF's DIR@SUBDIR: the files of one subdirectory
        return _locate(os.path.join(name, data_dir), flag)
    hint = ""
    if not os.path.isabs(name) and name.count("/") == 1 and not os.path.splitext(name)[1]:
        hint = f"; {name!r} looks like a Hugging Face Hub dataset: download it and pass its local directory"
    raise ValueError(f"{flag} {source}: no such file or directory (hub names are not downloaded; pass a local "
                     f"JSON/JSONL/parquet file, a directory of them or a save_to_disk directory{hint})")


def _source_rows(source: str, split: str, cap: int, flag: str) -> list[Row]:
    path, kind = _locate(source, flag)
    where = f"{flag} {source}"
    if os.path.isfile(path):
        ext = os.path.splitext(path)[1].lower()
        if ext not in DATA_EXTENSIONS:
            raise ValueError(f"{where}: unsupported file type {ext or '(none)'!r}; use JSON/JSONL "
                             "(.json, .jsonl) or parquet (convert the file, or save it with save_to_disk)")
        files = [(path, DATA_EXTENSIONS[ext])]
    elif kind is None and _is_saved_dataset(path):
        return _saved_dataset_rows(path, split, cap, where)
    else:
        files = _split_files(path, kind, split, where)
    rows: list[Row] = []
    for file, file_kind in files:
        for number, data in enumerate(_READERS[file_kind](file), 1):
            if not isinstance(data, dict):
                raise ValueError(f"{file}, row {number}: expected an object of named columns, "
                                 f"got {type(data).__name__}")
            rows.append(Row(file, number, data))
            if len(rows) >= cap:
                return rows
    return rows


# --- mixing ---------------------------------------------------------------------------------------


def parse_probs(probs: str, num_sources: int, flag: str) -> list[float]:
    """The probabilities of `--dataset_probs` (`flag` is the dataset flag; its probs flag is
    `{flag}_probs`), checked: one per source, none negative or zero, summing to 1 (within 1e-6)."""
    probs_flag = f"{flag}_probs"
    try:
        values = [float(p) for p in probs.split(",")]
    except ValueError as err:
        raise ValueError(f"{probs_flag} {probs}: not a comma-separated list of numbers") from err
    if len(values) != num_sources:
        raise ValueError(f"{probs_flag} {probs}: {len(values)} probabilities for {num_sources} sources in "
                         f"{flag}; give one per source, in the same order")
    if any(not p > 0 for p in values):
        raise ValueError(f"{probs_flag} {probs}: every probability must be > 0 (OpenRLHF mixes until every "
                         f"source is used up, which a never-drawn source never is); drop that source from {flag}")
    total = sum(values)
    if abs(total - 1.0) > 1e-6:
        raise ValueError(f"{probs_flag} {probs}: probabilities sum to {total:g}, not 1; rescale them")
    # numpy accepts sums within ~1.5e-8 of 1; pass those unchanged so the draws equal HF's bit for bit
    return values if abs(total - 1.0) <= 1e-8 else [p / total for p in values]


def interleave_order(lengths: list[int], probs: list[float], seed: int) -> list[tuple[int, int]]:
    """(source, row) pairs in the order HF `interleave_datasets(probabilities=probs, seed=seed,
    stopping_strategy="all_exhausted")` yields them: sources drawn with numpy's `default_rng(seed)` in
    blocks of 1000, each source's rows taken in order and wrapping around, until every source has been
    drawn at least `len(source)` times (its last row just taken). Every length must be > 0."""
    import numpy as np

    rng = np.random.default_rng(seed)
    lengths_arr = np.asarray(lengths, dtype=np.int64)
    counts = np.zeros(len(lengths), dtype=np.int64)
    blocks = []
    while not (counts >= lengths_arr).all():
        block = rng.choice(len(lengths), size=1000, p=probs)
        blocks.append(block)
        counts += np.bincount(block, minlength=len(lengths))
    draws = np.concatenate(blocks)
    stop = max(int(np.flatnonzero(draws == s)[n - 1]) for s, n in enumerate(lengths))
    taken = [0] * len(lengths)
    order = []
    for s in draws[: stop + 1].tolist():
        order.append((s, taken[s] % lengths[s]))
        taken[s] += 1
    return order


def read_rows(dataset: str, *, probs: str | None, split: str, max_samples: int, seed: int,
              flag: str) -> list[Row]:
    """The rows of `dataset` (an OpenRLHF `--dataset` value), mixed and capped as OpenRLHF does.

    Each source is read up to `max_samples` rows (OpenRLHF's `max_count`); without `probs` the sources
    are concatenated in order, with `probs` (`--dataset_probs`) they are interleaved by
    `interleave_order` with `seed` (sources drawn more often than they have rows repeat rows). The result
    is cut to `max_samples` rows. `flag` names the dataset flag in errors (`--dataset`,
    `--eval_dataset`, ...); a missing file, an unreadable row or bad probabilities is a ValueError naming
    the file and row or the flag, and the fix.
    """
    if max_samples < 1:
        raise ValueError(f"--max_samples {max_samples}: must be at least 1")
    sources = [s.strip() for s in dataset.split(",")]
    if not all(sources):
        raise ValueError(f"{flag} {dataset!r}: empty source name; separate sources with single commas")
    weights = parse_probs(probs, len(sources), flag) if probs is not None else None
    per_source = [_source_rows(s, split, max_samples, flag) for s in sources]
    if weights is None:
        rows = [row for rows in per_source for row in rows]
    else:
        for source, rows in zip(sources, per_source):
            if not rows:
                raise ValueError(f"{flag} {source}: no rows to mix with {flag}_probs; remove this source")
        order = interleave_order([len(r) for r in per_source], weights, seed)
        rows = [per_source[s][i] for s, i in order[:max_samples]]
    if not rows:
        raise ValueError(f"{flag} {dataset}: no rows (split {split!r})")
    return rows[:max_samples]
