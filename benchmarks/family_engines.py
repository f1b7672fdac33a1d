"""Every family of the tiny zoo through the vLLM engine (what tests/e2e/test_model_families_vllm.py checks on four of
them in CI, here on all): after one AdamW step of the actor and a weight push, the largest difference between the
engine's log-probs and the actor's (padded and packed forwards) on chat-prompted samples, how far the push moved
the engine, and how the samples stopped. One vLLM start per family (about 20 s each on 2 CPU cores).

    python benchmarks/family_engines.py [--families mixtral gemma2 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    sys.path.insert(0, ROOT)
    from rlhf.models.zoo import FAMILIES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "report.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "--master_addr=127.0.0.1",
               "--master_port=29533", "tests/workers/family_engines.py", out, os.path.join(tmp, "zoo"),
               *args.families]
        proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(proc.stderr[-4000:])
        with open(out) as f:
            report = json.load(f)
    print("| family | tokens | max abs diff, padded | max abs diff, packed | push moved by | stopped (on turn end) |")
    print("|---|---|---|---|---|---|")
    for name, r in report.items():
        print(f"| {name} | {r['num_tokens']} | {r['padded_max_abs_diff']:.1e} | {r['packed_max_abs_diff']:.1e} | "
              f"{r['diff_vs_initial_weights']:.2f} | {r['stopped']} ({r['stopped_on_turn_end']}); "
              f"{r['stop_token_inside']} ran past a stop id |")


if __name__ == "__main__":
    main()
