"""RLHF training on one SPMD program (see README.md)."""

import os

if "DS_ACCELERATOR" not in os.environ:
    import torch

    if torch.version.cuda is None and not torch.cuda.is_available():
        # A CPU build of torch: name the accelerator DeepSpeed would pick, so its import does not print a
        # warning before our first line. (A CUDA build decides at DeepSpeed's import, as usual.)
        os.environ["DS_ACCELERATOR"] = "cpu"
