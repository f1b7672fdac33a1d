"""RLHF training on one SPMD program (see README.md)."""

import importlib.util
import os
import re


def _cpu_torch_build() -> bool | None:
    """Whether the installed torch is a CPU build (no CUDA, no ROCm), read from its version.py without importing
    torch (seconds a refused command need not spend); None when that file cannot be read."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        with open(os.path.join(next(iter(spec.submodule_search_locations)), "version.py")) as f:
            text = f.read()
    except OSError:
        return None
    builds = [re.search(rf"^{name}(?::[^=\n]*)? = (.+)$", text, re.M) for name in ("cuda", "hip")]
    if None in builds:
        return None
    return all(found.group(1).strip() == "None" for found in builds)


if "DS_ACCELERATOR" not in os.environ:
    cpu_build = _cpu_torch_build()
    if cpu_build is None:
        import torch

        cpu_build = torch.version.cuda is None and torch.version.hip is None and not torch.cuda.is_available()
    if cpu_build:
        # A CPU build of torch: name the accelerator DeepSpeed would pick, so its import does not print a
        # warning before our first line. (A CUDA build decides at DeepSpeed's import, as usual.)
        os.environ["DS_ACCELERATOR"] = "cpu"
