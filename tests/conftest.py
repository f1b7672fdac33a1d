"""Test levels are folders: tests/unit, tests/dist, tests/e2e, tests/examples and tests/gpu (see tests/README.md).
Each collected test gets its folder's marker, a test file outside a level folder is an error (it would run in no
CI step), and `gpu` tests are skipped where CUDA is not available. Under pytest-xdist (`-n 2 --dist loadfile`,
setup.cfg) the tests of one file share a worker, so a module fixture runs once."""

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")

LEVELS = ("unit", "dist", "e2e", "examples", "gpu")
TESTS = Path(__file__).parent


def level_of(path: Path) -> str | None:
    """The level folder `path` lives in, or None outside every level."""
    try:
        parts = Path(path).resolve().relative_to(TESTS.resolve()).parts
    except ValueError:
        return None
    return parts[0] if len(parts) > 1 and parts[0] in LEVELS else None


def pytest_collection_modifyitems(config, items):
    stray = sorted({str(item.path) for item in items if level_of(item.path) is None})
    if stray:
        raise pytest.UsageError(f"test files outside a level folder ({', '.join(LEVELS)}) run in no CI step: "
                                f"move {', '.join(stray)} into one")
    skip_gpu = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        level = level_of(item.path)
        item.add_marker(level)
        if level == "gpu" and skip_gpu is not None:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def launch_server():
    """One preloaded launch server per test process (tests/launch_server.py), for the scripts that send their
    launches to it (launch/examples/common.sh, benchmarks/gpu_throughput_run.py)."""
    from tests.launch_server import serving

    with serving() as path:
        yield path
