"""Reward summaries of scored batch-inference outputs, one JSON line per named stage: what the generation
pipelines' example scripts (rejection sampling, iterative DPO, conditional SFT) record per iteration so that
a run shows whether the policy's reward-model score rises. Reads the rows `batch_inference --eval_task rm`
writes ({"input", "output", "reward"}); knows nothing of models or ranks.

`python -m rlhf.inference.summary OUT.jsonl NAME=SCORED.jsonl [NAME=SCORED.jsonl ...]` writes OUT.jsonl afresh
(so a rerun of a script does not repeat lines) and prints each line.
"""

from __future__ import annotations

import json
import re
import sys

from rlhf.inference.output import write_atomically
from rlhf.inference.post_process import reward_stats

_COPY_DIGIT = re.compile(r"\bcopy (\S+) :")


def copy_task_reward(row: dict) -> float | None:
    """The embedded demo's rule reward (`rlhf/assets/tiny/reward.py`): the fraction of the first four answer
    words equal to the word after "copy" in the prompt; None for a prompt that is not a copy task."""
    match = _COPY_DIGIT.search(row["input"])
    if match is None:
        return None
    return sum(word == match.group(1) for word in row["output"].split()[:4]) / 4


def summarize(rows: list[dict]) -> dict:
    """{"rows", "rm_score" (mean reward), "rm_score_std" (unbiased), and "rule_reward" (mean copy-task reward)
    where every prompt is a copy task}. A ValueError for no rows."""
    if not rows:
        raise ValueError("no scored rows to summarize")
    mean, std = reward_stats(rows)
    summary = {"rows": len(rows), "rm_score": round(mean, 4), "rm_score_std": round(std, 4)}
    rule = [copy_task_reward(row) for row in rows]
    if all(r is not None for r in rule):
        summary["rule_reward"] = round(sum(rule) / len(rule), 4)
    return summary


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or not all("=" in arg for arg in argv[1:]):
        raise SystemExit("usage: python -m rlhf.inference.summary OUT.jsonl NAME=SCORED.jsonl [NAME=SCORED.jsonl ...]")
    lines = []
    for arg in argv[1:]:
        name, path = arg.split("=", 1)
        lines.append(json.dumps({"stage": name, **summarize(read_jsonl(path))}))
    write_atomically(argv[0], "".join(line + "\n" for line in lines))
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
