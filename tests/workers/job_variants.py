"""Several command lines of the jobs, one after another in one torchrun process (one interpreter start, one
process group, the libraries imported once), so that the variants of one equivalence pay one launch:

    torchrun --nproc_per_node N tests/workers/job_variants.py SPEC.json

SPEC is a list of [module, argv] (module: `train_sft`, `train_rm`, ...). Every run gets `--watchdog_interval 0`
(the watchdog of an earlier run would otherwise time the later ones). Before each run rank 0 prints
`=== variant I ===` on stdout and on stderr so the caller can split the output per run."""

import importlib
import json
import os
import sys

from rlhf.cli.entry_point import end_program


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    for i, (module, argv) in enumerate(spec):
        if os.environ.get("RANK", "0") == "0":
            print(f"=== variant {i} ===", flush=True)
            print(f"=== variant {i} ===", file=sys.stderr, flush=True)
        importlib.import_module(f"rlhf.cli.{module}").main([*argv, "--watchdog_interval", "0"])
    end_program()


if __name__ == "__main__":
    main(sys.argv[1])
