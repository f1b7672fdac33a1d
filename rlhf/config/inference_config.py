"""The config root of `batch_inference`: generation with vLLM or HF generate, scoring with a reward model,
the post-processors of the generation pipelines (rejection sampling, iterative DPO, conditional SFT), with
OpenRLHF v0.9.5's flag names and defaults, plus the chunking that makes a run restartable. Knows nothing of
argparse, engines or files.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from typing import ClassVar

from rlhf.assets import EMBEDDED_MODEL_DIR, EMBEDDED_PROMPTS, EMBEDDED_REWARD_MODEL_DIR, EMBEDDED_SFT_EVAL
from rlhf.config.shared_config import JobConfig, opt, require
from rlhf.config.supervised_config import DEMO_TEMPLATE, ScalarHeadModelConfig

EVAL_TASKS = ("generate_vllm", "generate", "rm")
POST_PROCESSORS = ("rs", "csft", "iter_dpo")


DEMO_LENGTHS = {"prompt_max_len": 32, "max_new_tokens": 8, "max_len": 64}
"""Lengths the embedded demo runs with where the defaults (sized for real models) are still set: the tiny
model has 256 positions, and a copy-task answer is four words and EOS."""


@dataclass(frozen=True, kw_only=True)
class InferenceEngineConfig:
    """How the model is held: replicated on every rank (ZeRO-0), as OpenRLHF's batch_inference defaults to."""

    zero_stage: int = opt(0, "DeepSpeed ZeRO stage: 0 (each rank holds the whole model; the only stage built "
                          "for batch_inference)")
    local_rank: int = opt(-1, "accepted for compatibility with deepspeed launchers; the environment wins")

    def __post_init__(self) -> None:
        require(self.zero_stage == 0, f"--zero_stage {self.zero_stage}: batch_inference holds the whole model on "
                "every rank; ZeRO-1-3 sharding is not built for it: pass --zero_stage 0")


@dataclass(frozen=True, kw_only=True)
class InferenceDataConfig:
    """Where the rows come from, how prompts are formatted, and where the results go."""

    dataset: str | None = opt(None, "input rows: comma-separated local JSON/JSONL/parquet files or directories, HF "
                              "save_to_disk directories, or json@DIR (required with --pretrain; without it: the "
                              "embedded demo data)")
    dataset_probs: str | None = opt(None, "sampling probabilities of the --dataset sources, comma separated")
    dataset_split: str = opt("train", "split to read from directories and saved datasets with splits")
    input_key: str = opt("input", "column of the prompt (or of the messages with --apply_chat_template)")
    output_key: str = opt("output", "column of the response to score (--eval_task rm)")
    input_template: str | None = opt(None, "format string with one {} wrapped around each prompt")
    apply_chat_template: bool = opt(False, "format prompts with the tokenizer's chat template")
    tokenizer_chat_template: str | None = opt(None, "a Jinja chat template overriding the tokenizer's")
    max_len: int = opt(2048, "maximum tokens of a scored prompt + response (--eval_task rm; longer ones are cut)")
    max_samples: int = opt(int(1e8), "read at most this many rows")
    output_path: str | None = opt(None, "the JSON Lines file written (required); its progress record is "
                                  "OUTPUT_PATH.progress.json")

    def __post_init__(self) -> None:
        require(self.max_samples >= 1, "--max_samples must be >= 1")
        require(self.max_len >= 3, "--max_len must be >= 3")
        require(self.output_path is None or bool(self.output_path), "--output_path must name a file")
        if self.input_template is not None:
            require(self.input_template.count("{}") == 1,
                    f"--input_template {self.input_template!r} must contain exactly one '{{}}' for the prompt")


@dataclass(frozen=True, kw_only=True)
class GenerationConfig:
    """Sampling, and which slice of the prompts one invocation generates for (--eval_task generate*)."""

    prompt_max_len: int = opt(1024, "prompts longer than this many tokens are dropped, with a count")
    max_new_tokens: int = opt(1024, "maximum number of generated tokens per sample")
    greedy_sampling: bool = opt(False, "greedy decoding")
    top_p: float = opt(1.0, "nucleus sampling probability mass")
    temperature: float = opt(1.0, "sampling temperature (0: greedy)")
    repetition_penalty: float = opt(1.0, "penalty on tokens already in the prompt or the output (1: none)")
    best_of_n: int = opt(1, "samples per prompt")
    iter: int | None = opt(None, "generate only the prompts [iter x rollout_batch_size, (iter + 1) x "
                           "rollout_batch_size) (iterative pipelines; default: every prompt)")
    rollout_batch_size: int = opt(2048, "prompts per --iter slice")
    enable_csft: bool = opt(False, "append --csft_prompt to every prompt (conditional SFT generation)")
    csft_prompt: str = opt("<rm_score>: 5.00", "the reward condition appended with --enable_csft")

    def __post_init__(self) -> None:
        require(self.prompt_max_len >= 1, "--prompt_max_len must be >= 1")
        require(self.max_new_tokens >= 1, "--max_new_tokens must be >= 1")
        require(0 < self.top_p <= 1, "--top_p must lie in (0, 1]")
        require(self.temperature >= 0, "--temperature must be >= 0")
        require(self.repetition_penalty > 0, "--repetition_penalty must be positive (1: no penalty)")
        require(self.best_of_n >= 1, "--best_of_n must be >= 1")
        require(self.iter is None or self.iter >= 0, "--iter must be >= 0")
        require(self.rollout_batch_size >= 1, "--rollout_batch_size must be >= 1")

    @property
    def greedy(self) -> bool:
        return self.greedy_sampling or self.temperature == 0


@dataclass(frozen=True, kw_only=True)
class InferenceVLLMConfig:
    """The in-process vLLM engines of --eval_task generate_vllm."""

    tp_size: int | None = opt(None, "ranks per vLLM engine, consecutive ranks (default: the ranks of one node, "
                              "as OpenRLHF's default of every visible GPU)")
    enable_prefix_caching: bool = opt(False, "vLLM prefix caching")
    vllm_kv_cache_bytes: int = opt(64 << 20, "KV-cache bytes per engine on CPU (vLLM needs an explicit size)")
    vllm_gpu_memory_utilization: float = opt(0.9, "fraction of GPU memory vLLM may take (CUDA)")
    enforce_eager: bool = opt(False, "run vLLM's model eagerly: no CUDA graphs, and on CPU no torch.compile "
                               "(CPU, compiled: +1-26 s at start, each call 0.77-1.03x eager's time; "
                               "benchmarks/vllm_cpu_modes.py)")
    max_num_seqs: int = opt(256, "most sequences a vLLM engine runs in one batch")

    def __post_init__(self) -> None:
        require(self.tp_size is None or self.tp_size >= 1, "--tp_size must be >= 1")
        require(self.max_num_seqs >= 1, "--max_num_seqs must be >= 1")
        require(self.vllm_kv_cache_bytes >= 1, "--vllm_kv_cache_bytes must be >= 1")
        require(0 < self.vllm_gpu_memory_utilization <= 1, "--vllm_gpu_memory_utilization must lie in (0, 1]")


@dataclass(frozen=True, kw_only=True)
class ScoringConfig:
    """Reward-model scoring (--eval_task rm) and the post-processor applied to the scored rows."""

    micro_batch_size: int = opt(16, "rows per reward-model forward, per rank")
    post_processor: str | None = opt(None, "after scoring: rs (best output per prompt, rejection sampling), csft "
                                     "(reward written into the prompt, conditional SFT), iter_dpo (best/worst "
                                     "output per prompt as chosen/rejected) or null")
    normalize_reward: bool = opt(False, "csft: standardise the rewards over the whole output (mean 0, std 1) "
                                 "before writing them into the prompts")
    reward_template: str | None = opt(None, "csft: the prompt written, with {input} and {reward} (default "
                                      "'{input} <rm_score>: {reward} ')")

    def __post_init__(self) -> None:
        require(self.micro_batch_size >= 1, "--micro_batch_size must be >= 1")
        require(self.post_processor in (None, "null", *POST_PROCESSORS),
                f"--post_processor {self.post_processor!r}: choose rs, csft, iter_dpo or null")
        if self.reward_template is not None:
            require("{input}" in self.reward_template and "{reward}" in self.reward_template,
                    f"--reward_template {self.reward_template!r} must contain {{input}} and {{reward}}")

    @property
    def processor(self) -> str | None:
        """The post-processor's name, None for none (OpenRLHF reads "null" as none too)."""
        return None if self.post_processor in (None, "null") else self.post_processor


@dataclass(frozen=True, kw_only=True)
class BatchInferenceConfig(JobConfig):
    """Everything `batch_inference` needs."""

    PENDING_FLAGS: ClassVar[tuple[str, ...]] = ()
    eval_task: str | None = opt(None, "generate_vllm (in-process vLLM on every rank), generate (HF transformers "
                                "generate) or rm (score --input_key + --output_key rows with a reward model)")
    seed: int = opt(1234, "random seed: each prompt samples from a seed derived from it and the prompt's index")
    model: ScalarHeadModelConfig = field(default_factory=lambda: ScalarHeadModelConfig(value_head_prefix="value_head"))
    engine: InferenceEngineConfig = field(default_factory=InferenceEngineConfig)
    data: InferenceDataConfig = field(default_factory=InferenceDataConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    vllm: InferenceVLLMConfig = field(default_factory=InferenceVLLMConfig)
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    chunk_size: int = opt(1024, "prompts (rm: rows) per chunk, over all ranks: after each chunk the output file "
                          "and its progress record advance, and a rerun of an interrupted run resumes there")
    verbose: bool = opt(False, "show all third-party library output on the console, unfiltered, from every rank")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.eval_task in EVAL_TASKS, f"--eval_task {self.eval_task}: choose generate_vllm (vLLM), "
                "generate (HF transformers) or rm (score rows with a reward model)")
        require(self.data.output_path is not None, "--output_path is required: the JSON Lines file to write")
        require(self.chunk_size >= 1, "--chunk_size must be >= 1")
        require(self.model.lora == type(self.model.lora)(), "the LoRA flags (--lora_rank, --load_in_4bit, ...) "
                "train adapters; batch_inference runs --pretrain as saved: merge an adapter into its base model "
                "first (python -m rlhf.cli.lora_combiner) and pass the merged directory")
        if self.model.gradient_checkpointing:
            warnings.warn("--gradient_checkpointing has no effect in batch_inference (nothing is trained)",
                          stacklevel=3)
        if self.eval_task == "rm":
            self._check_rm()
        else:
            self._check_generate()

    def _check_generate(self) -> None:
        g, s = self.generation, self.scoring
        if self.eval_task == "generate":
            require(self.vllm.tp_size in (None, 1), f"--tp_size {self.vllm.tp_size}: --eval_task generate runs "
                    "one HF model per rank; tensor parallelism needs --eval_task generate_vllm")
        require(not (g.greedy and g.best_of_n > 1), f"greedy decoding gives --best_of_n {g.best_of_n} identical "
                "samples: drop --greedy_sampling / --temperature 0, or pass --best_of_n 1")
        ignored = [flag for flag, on in (("--post_processor", s.processor is not None),
                                         ("--normalize_reward", s.normalize_reward),
                                         ("--reward_template", s.reward_template is not None),
                                         ("--micro_batch_size", s.micro_batch_size != ScoringConfig().micro_batch_size))
                   if on]
        if ignored:
            warnings.warn(f"ignored with --eval_task {self.eval_task}: {', '.join(ignored)} (settings of --eval_task "
                          "rm, scoring)", stacklevel=3)

    def _check_rm(self) -> None:
        g, s = self.generation, self.scoring
        defaults = GenerationConfig()
        ignored = [f"--{name}" for name in ("iter", "enable_csft", "greedy_sampling", "best_of_n")
                   if getattr(g, name) != getattr(defaults, name)]
        if ignored:
            warnings.warn(f"ignored with --eval_task rm, which scores every row (as OpenRLHF): {', '.join(ignored)} "
                          "(generation settings)", stacklevel=3)
        csft_only = [flag for flag, on in (("--normalize_reward", s.normalize_reward),
                                           ("--reward_template", s.reward_template is not None)) if on]
        if csft_only and s.processor != "csft":
            warnings.warn(f"ignored without --post_processor csft: {', '.join(csft_only)}", stacklevel=3)

    def with_demo_defaults(self) -> BatchInferenceConfig:
        """The config to run. Without --pretrain: the embedded tiny policy (generation) or reward model (rm),
        the embedded prompts (generation) or copy-task demonstrations (rm) where no --dataset is given (with the
        demo template where the default one is still set), and lengths that fit the tiny model where the
        defaults are still set. With --pretrain nothing is filled in, and --dataset is required."""
        m, d = self.model, self.data
        if m.pretrain is not None:
            require(d.dataset is not None, f"--pretrain {m.pretrain} is given but --dataset is not: name the input "
                    "rows (the embedded demo data is used only without --pretrain)")
            return self
        rm = self.eval_task == "rm"
        if d.dataset is None:
            d = replace(d, dataset=EMBEDDED_SFT_EVAL if rm else EMBEDDED_PROMPTS)
            if d.input_template is None and not d.apply_chat_template:
                d = replace(d, input_template=DEMO_TEMPLATE)
        g, g_default = self.generation, GenerationConfig()
        lengths = {name: DEMO_LENGTHS[name] for name in ("prompt_max_len", "max_new_tokens")
                   if getattr(g, name) == getattr(g_default, name)}
        if d.max_len == InferenceDataConfig().max_len:
            d = replace(d, max_len=DEMO_LENGTHS["max_len"])
        return replace(self, model=replace(m, pretrain=EMBEDDED_REWARD_MODEL_DIR if rm else EMBEDDED_MODEL_DIR),
                       data=d, generation=replace(g, **lengths))
