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

JOB_MODULE = "rlhf.jobs.inference_run"  # the run, imported once the flags have parsed (and by rlhf.cli.warm_start)
PROG = "python -m rlhf.cli.batch_inference"


def main(argv: list[str] | None = None) -> None:
    main_for(BatchInferenceConfig, deferred(JOB_MODULE), PROG, argv)


def warm_imports(argv: list[str]) -> list[str]:
    """What a worker of this command imports (`rlhf.cli.warm_start`): the run, and vLLM's engine for
    --eval_task generate_vllm."""
    from rlhf.cli.warm_start import VLLM_ENGINE_MODULES, quietly_parsed

    cfg = quietly_parsed(BatchInferenceConfig, argv, PROG)
    return [JOB_MODULE, *(VLLM_ENGINE_MODULES if cfg is not None and cfg.eval_task == "generate_vllm" else [])]


if __name__ == "__main__":
    main()
