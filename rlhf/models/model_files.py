"""The files of a local HF model directory, checked before any engine starts: config.json parses, the weight
files exist, and every safetensors file's header reads and its tensors' byte ranges lie inside the file (a
truncated copy is caught here, not when an engine loads it minutes later). Reads headers only."""

from __future__ import annotations

import json
import os
import struct

from rlhf.config.errors import UsageError

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def _json_problem(file: str) -> str | None:
    try:
        with open(file, encoding="utf-8") as f:
            json.load(f)
    except UnicodeDecodeError as err:
        return f"{file}: not UTF-8 text ({err.reason} at byte {err.start})"
    except json.JSONDecodeError as err:
        return f"{file}: not valid JSON (line {err.lineno}, column {err.colno}: {err.msg})"
    except OSError as err:
        return f"{file}: cannot be read ({err.strerror or err})"
    return None


def safetensors_problem(file: str) -> str | None:
    """What is wrong with a safetensors file (None: its header reads and covers the file's data), from its
    first 8 + N bytes."""
    try:
        size = os.path.getsize(file)
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{file}: {size} bytes, too short for a safetensors header (truncated?)"
            (n,) = struct.unpack("<Q", head)
            if 8 + n > size:
                return f"{file}: its header claims {n} bytes but the file has {size} (truncated?)"
            header = json.loads(f.read(n))
    except (OSError, ValueError) as err:
        return f"{file}: its safetensors header cannot be read ({err})"
    ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
    needed = 8 + n + max(ends, default=0)
    if needed > size:
        return f"{file}: truncated: its tensors need {needed} bytes, the file has {size}"
    return None


def model_file_problems(path: str) -> list[str]:
    """One line per problem of the model directory `path` (which holds config.json)."""
    problems = [p for p in [_json_problem(os.path.join(path, "config.json"))] if p]
    weights = [name for name in WEIGHT_FILES if os.path.isfile(os.path.join(path, name))]
    for index_name in INDEX_FILES:
        index = os.path.join(path, index_name)
        if not os.path.isfile(index):
            continue
        problem = _json_problem(index)
        if problem:
            problems.append(problem)
            continue
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f).get("weight_map", {}).values()))
        missing = [s for s in shards if not os.path.isfile(os.path.join(path, s))]
        if missing:
            problems.append(f"{index} names {len(missing)} shard(s) that are missing: {', '.join(missing[:3])}"
                            + (" ..." if len(missing) > 3 else ""))
        weights += [s for s in shards if s not in missing]
    if not weights:
        problems.append(f"{path}: no weight files ({', '.join(WEIGHT_FILES)} or a sharded index)")
    for name in weights:
        file = os.path.join(path, name)
        if name.endswith(".safetensors"):
            problem = safetensors_problem(file)
        else:
            problem = f"{file}: empty" if os.path.getsize(file) == 0 else None
        if problem:
            problems.append(problem)
    return problems


def check_model_files(path: str, flag: str) -> None:
    """`UsageError` naming `flag` and every problem of the model directory `path`, one line each."""
    problems = model_file_problems(path)
    if problems:
        raise UsageError(f"{flag} {path} cannot be loaded:\n" + "\n".join(f"  {p}" for p in problems))
