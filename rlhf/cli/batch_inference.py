"""Entry point of batch inference: `torchrun ... -m rlhf.cli.batch_inference --eval_task generate_vllm|generate|rm
--pretrain DIR --dataset DATA --output_path OUT.jsonl` (or srun, or plain `python -m` for one rank), with
OpenRLHF v0.9.5's batch_inference flags. Without --pretrain: the embedded tiny policy (generation) or reward
model (rm) on the embedded data.

The output is written in chunks (see `rlhf.inference.output`): rerunning an interrupted run with the same
flags and inputs resumes after its last finished chunk and ends with the file an uninterrupted run writes;
SIGTERM/SIGUSR1 stop a run at the next chunk boundary with exit status 75 (rerun to continue).
"""

from __future__ import annotations

from rlhf.cli.entry_point import deferred, main_for
from rlhf.config.inference_config import BatchInferenceConfig


def main(argv: list[str] | None = None) -> None:
    main_for(BatchInferenceConfig, deferred("rlhf.jobs.inference_run"), "python -m rlhf.cli.batch_inference", argv)


if __name__ == "__main__":
    main()
