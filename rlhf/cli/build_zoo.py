"""Build random-weight models of the common families into directories, each with its own BPE tokenizer, chat
template and generation eos ids (`rlhf.models.zoo`: what each family's tokenizer reproduces and at what shape).

    python -m rlhf.cli.build_zoo --family mixtral --out /tmp/zoo/mixtral
    python -m rlhf.cli.build_zoo --family all --out /tmp/zoo          (one directory per family under --out)
"""

from __future__ import annotations

import argparse
import os


def main(argv: list[str] | None = None) -> None:
    from transformers.utils import logging as hf_logging

    from rlhf.models.zoo import FAMILIES, build_family

    hf_logging.disable_progress_bar()  # transformers' save bar, once per model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", required=True, choices=[*FAMILIES, "all"])
    parser.add_argument("--out", required=True, help="the model directory (with --family all: their parent)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    names = list(FAMILIES) if args.family == "all" else [args.family]
    for name in names:
        path = os.path.join(args.out, name) if args.family == "all" else args.out
        build_family(name, path, args.seed)
        print(f"{name}: {path}  ({'; '.join(FAMILIES[name].notes)})")


if __name__ == "__main__":
    main()
