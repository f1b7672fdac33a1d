"""Peak memory per rank and per stage of a job, estimated from model shapes and settings alone (pure
functions, bytes throughout). A `JobMemory` says which models a job holds on which ranks and what each stage
runs; `estimate` turns it into one `Breakdown` per rank and stage. Knows nothing of flags or config roots
(`rlhf.planning.job_memory` maps those onto a `JobMemory`).

Where each term comes from (P: a model's parameters, b: bytes of the parameter dtype, n: the ranks of the
model's role, ZeRO partitions over all of them; ring-attention ranks included):
- weights: P·b, or P·b/n at ZeRO-3 plus the gathered parameters DeepSpeed keeps between forwards: up to
  stage3_max_live_parameters (1e9 elements, which with the default stage3_max_reuse_distance of 1e9 are not
  released), min(P, 1e9)·b per ZeRO-3 model, trained or frozen (measured on CPU: a PPO job's actor and reference
  at ZeRO-3 hold this much more than their shards outside training), and during a ZeRO-3 forward or backward
  the flat buffer the all-gathers fill, min(P, 5e7)·b (stage3_prefetch_bucket_size).
- gradients (trained models; LoRA: the adapters' parameters only): ZeRO-0/1 P·b; ZeRO-2 and 3 the reduce bucket
  (5e8 elements: every gradient of a smaller model, min(P, 5e8)·b) + the fp32 gradient partition 4·P/n, and at
  ZeRO-3 the 16-bit gradient shard P·b/n too; only during the model's own training pass (its optimizer step
  sets them to None).
  On CUDA the reduce bucket counts whole, whatever P: DeepSpeed allocates all 5e8 elements (twice with
  --overlap_comm) and max_memory_allocated counts the allocation, where on CPU only the pages the gradients
  write become resident. ZeRO-1/2 allocate it at each training pass's first backward (ZeRO-1 in the
  --grad_accum_dtype when it differs from the parameters') and free it after the pass; ZeRO-3 allocates it when
  the engine starts and keeps it, with its 16-bit gradient shard (P·b/n), in every stage but those that
  --deepspeed_enable_sleep offloads it from (measured on an H200: the embedded tiny model's ZeRO-2 training pass
  peaked 954 MiB above its other stages, 5e8·2 bytes).
- optimizer states: Adam's two fp32 moments (8 bytes/param) and an fp32 master copy (4 bytes/param), which
  DeepSpeed keeps at ZeRO >= 1 even for fp32 parameters (a cloned flat partition) and at ZeRO-0 only for 16-bit
  ones: 12 bytes/param (8 for fp32 at ZeRO-0), over n at ZeRO >= 1; on the host with --adam_offload.
- activations of one training micro-batch (`Activations`), per token and block in a Llama block with autograd:
  both RMSNorms keep their fp32 input and normalised output plus the output in the parameter dtype (2·(8+b)·d
  bytes), attention keeps rotated q, k, v, its output and the o_proj input (b·(3·q + 2·kv)), the gated MLP keeps
  gate, up, SiLU(gate) and their product (4·b·i); eager attention adds heads·T² scores and probabilities per
  sequence. Gradient checkpointing keeps each block's input (b·d per token and block) plus one block recomputed.
  A ring of r ranks holds tokens/r of each sequence.
- logits of one micro-batch: tokens x vocab x b, twice while training (the logits and their gradient); the
  log-probs themselves are computed in chunks and never hold an fp32 copy of the logits.
- rollout engine: its own weights (P·b over its tensor-parallel ranks) and KV cache (vLLM: the given bytes
  per engine on CPU, on CUDA --vllm_gpu_memory_utilization of the device minus its weights; transformers'
  generate: 2·layers·kv_dim·b per token of the rank's sequences). With sleep (CUDA) both leave the device
  during experience and training (it wakes for the weight sync).
- weight sync: a bucket of --weight_sync_bucket_mb where the actor's weights are gathered from ZeRO-3 shards
  or received by a rank without the actor (a colocated unpartitioned actor hands its tensors over directly).
- a fixed runtime reserve (CUDA context, communication buffers, allocator fragmentation) that neither
  max_memory_allocated nor an RSS delta sees: counted for "fits", left out of the comparison with measured
  peaks.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from rlhf.planning.model_shapes import ModelShape

GiB = 1 << 30
ZERO3_PREFETCH_ELEMENTS = 5e7  # the engine's stage3_prefetch_bucket_size
ZERO3_LIVE_ELEMENTS = 1e9
"""The engine's stage3_max_live_parameters, with DeepSpeed's default stage3_max_reuse_distance (also 1e9): up to
this many gathered parameters of a ZeRO-3 model stay on the device between its forwards."""
REDUCE_BUCKET_ELEMENTS = 5e8  # the engine's reduce_bucket_size (ZeRO-2 and 3)
CUDA_RESERVE_BYTES = 3 * GiB
"""The CUDA context (~0.5 GiB), NCCL buffers and allocator fragmentation, assumed for "fits" on a GPU."""
COMPONENTS = ("weights", "gradients", "optimizer", "activations", "logits", "frozen_models", "rollout_weights",
              "kv_cache", "buffers", "reserve")
"""The parts of a breakdown, in the order the report prints them."""


@dataclass(frozen=True)
class Model:
    """One model of a job. `trained`: it has gradients and an optimizer; `scalar_head`: a critic or reward
    model (no vocabulary logits); `offload`: a frozen model's parameters (a trained one's gradients and optimizer
    states) live in host memory outside the stages that use them; `replicated`: whole on every rank whatever
    the ZeRO stage (a frozen model on ranks of its own)."""

    shape: ModelShape
    trained: bool
    scalar_head: bool = False
    offload: bool = False
    replicated: bool = False
    lora_rank: int = 0
    tp_split: int = 1  # one rank's share under tensor parallelism (`_split`): its parameters / this

    @property
    def params(self) -> int:
        return self.shape.params(self.scalar_head) // self.tp_split

    def partitioned(self, t: Training) -> bool:
        return t.zero_stage == 3 and not self.replicated

    @property
    def trainable_params(self) -> int:
        """The parameters with gradients: all of them, or LoRA's A and B on every linear layer of every block."""
        if not self.lora_rank:
            return self.params
        per_block = sum(self.lora_rank * (a + b) for a, b in self.shape.linear_dims())
        return self.shape.layers * per_block // self.tp_split


@dataclass(frozen=True)
class Training:
    """How trained models run (the engine's settings)."""

    dtype_bytes: int
    zero_stage: int
    adam_offload: bool = False
    gradient_checkpointing: bool = False
    eager_attention: bool = False
    ring_size: int = 1
    tp_size: int = 1  # --ds_tensor_parallel_size: weights, gradients and optimizer states split (as if every
    # parameter were in a split layer), ZeRO's partitions over ranks / tp_size; activations counted whole
    cuda: bool = False  # planned for a GPU: DeepSpeed's reduce buckets count whole (module docstring)
    overlap_comm: bool = False  # ZeRO-1/2 double their reduce bucket
    accum_bytes: int = 0  # --grad_accum_dtype's bytes; 0: the parameter dtype's


@dataclass(frozen=True)
class Pass:
    """One forward (`train`: with backward) of `role`'s model over a micro-batch of `tokens` tokens per rank
    before any ring split, sequences of at most `longest` tokens."""

    role: str
    tokens: int
    longest: int
    train: bool


@dataclass(frozen=True)
class Rollout:
    """The rollout engine on every rank: `vllm` (else transformers' generate), tensor-parallel size, KV bytes
    per engine (vLLM on CPU) or the device fraction it takes (vLLM on CUDA), and the tokens of the sequences one
    rank generates at once (transformers' KV cache). `sleep`: it leaves the device outside generation."""

    shape: ModelShape
    vllm: bool
    tp: int = 1
    kv_cache_bytes: int = 0
    gpu_fraction: float = 0.0
    tokens_per_rank: int = 0
    sleep: bool = False


@dataclass(frozen=True)
class JobMemory:
    """A job's models by role name, the ranks of each role, what each stage runs (passes that run one after
    another: the stage's peak is the largest), the rollout engine, the weight-sync bucket, the settings."""

    models: dict[str, Model]
    ranks: dict[str, tuple[int, ...]]
    stages: dict[str, tuple[Pass, ...]]
    training: Training
    rollout: Rollout | None = None
    sync_bucket_bytes: int = 0
    device_bytes: int | None = None  # CUDA: the device's memory (sizes vLLM's KV cache); None on CPU
    reserve_bytes: int = 0
    active: dict[str, tuple[str, ...]] = field(default_factory=dict)  # stage -> roles whose offloaded parts return


Breakdown = dict[str, int]


def estimate(job: JobMemory, world_size: int) -> dict[int, dict[str, Breakdown]]:
    """rank -> stage -> component -> bytes, for every rank and stage of `job`."""
    return {rank: {stage: stage_breakdown(job, rank, stage) for stage in job.stages} for rank in range(world_size)}


def total(breakdown: Breakdown, with_reserve: bool = True) -> int:
    return sum(v for k, v in breakdown.items() if with_reserve or k != "reserve")


def stage_breakdown(job: JobMemory, rank: int, stage: str) -> Breakdown:
    """What rank `rank` holds at the peak of `stage`: the models it hosts (resident), the largest of the
    stage's passes on its models (transient), the rollout engine and the reserve."""
    out = dict.fromkeys(COMPONENTS, 0)
    hosted = [role for role, ranks in job.ranks.items() if rank in ranks and role in job.models]
    active, t = job.active.get(stage, ()), job.training
    for role in hosted:
        for k, v in resident(_split(job.models[role], t), len(job.ranks[role]) // t.tp_size, t,
                             role in active).items():
            out[k] += v
    passes = [p for p in job.stages[stage] if p.role in hosted]
    transients = [pass_bytes(_split(job.models[p.role], t), p, len(job.ranks[p.role]) // t.tp_size, t)
                  for p in passes]
    trained = [job.models[r] for r in hosted if job.models[r].trained]
    if stage == "weight_sync" and (not trained or any(m.partitioned(t) for m in trained)):
        transients.append({"buffers": job.sync_bucket_bytes})  # gathered from shards, or received
    if transients:
        for k, v in max(transients, key=lambda t: sum(t.values())).items():
            out[k] += v
    if job.rollout is not None:
        for k, v in rollout_bytes(job.rollout, job.training.dtype_bytes, stage, job.device_bytes).items():
            out[k] += v
    out["reserve"] = job.reserve_bytes
    return out


def _split(model: Model, t: Training) -> Model:
    """One rank's share of `model` under tensor parallelism (`Training.tp_size`): its parameters / tp_size."""
    if t.tp_size == 1:
        return model
    return replace(model, tp_split=t.tp_size)


def resident(model: Model, n: int, t: Training, active: bool) -> Breakdown:
    """What a hosted model keeps between passes on one of its `n` ranks (`active`: in a stage that uses it,
    so offloaded parts are back on the device). Gradients are not resident: they belong to the model's
    training pass (`pass_bytes`), since its optimizer step drops them (DeepSpeed zeroes with set_to_none), so
    an actor and a critic trained one after the other on the same ranks never hold theirs at once."""
    b = t.dtype_bytes
    partitioned = model.partitioned(t)
    weights = model.params * b // n if partitioned else model.params * b
    gathered = {"buffers": int(min(model.params, ZERO3_LIVE_ELEMENTS) * b)} if partitioned else {}
    if not model.trained:
        return {"frozen_models": 0, "buffers": 0} if model.offload and not active else \
            {"frozen_models": weights, **gathered}
    p = model.trainable_params
    if model.offload and not active:  # --deepspeed_enable_sleep: gradients and optimizer states on the host
        return {"weights": weights, **gathered}
    if t.cuda and t.zero_stage == 3:  # allocated when the engine starts and kept
        gathered["buffers"] = gathered.get("buffers", 0) + zero3_resident_gradient_bytes(p, n, t)
    return {"weights": weights, "optimizer": optimizer_bytes(p, n, t), **gathered}


def zero3_resident_gradient_bytes(p: int, n: int, t: Training) -> int:
    """On CUDA, what a ZeRO-3 model's optimizer allocates at start-up and keeps: the whole reduce bucket and,
    without --adam_offload (which puts it on the host), the gradient shard in the --grad_accum_dtype."""
    shard = 0 if t.adam_offload else p * (t.accum_bytes or t.dtype_bytes) // n
    return int(REDUCE_BUCKET_ELEMENTS * t.dtype_bytes) + shard


def gradient_bytes(p: int, n: int, t: Training) -> int:
    """Gradients of `p` trainable parameters on one of `n` ranks during its training pass (see the module
    docstring); on CUDA at ZeRO-3 the bucket and fp32 partition are resident instead (`resident`)."""
    b, stage = t.dtype_bytes, t.zero_stage
    if stage == 0:
        return p * b
    if t.cuda and stage in (1, 2):  # DeepSpeed allocates the whole bucket (twice with --overlap_comm)
        bucket = int(REDUCE_BUCKET_ELEMENTS * (t.accum_bytes or b if stage == 1 else b)) * (2 if t.overlap_comm else 1)
    else:
        bucket = int(min(p, REDUCE_BUCKET_ELEMENTS) * b)
    if stage == 1:
        return p * b + (bucket if t.cuda else 0)
    if t.cuda and stage == 3:  # the fp32 copy of the shard the optimizer step reads
        return 0 if t.adam_offload else 4 * p // n
    partition = 0 if t.adam_offload else 4 * p // n
    return bucket + partition + (p * b // n if stage == 3 else 0)


def optimizer_bytes(p: int, n: int, t: Training) -> int:
    """Adam's moments and the fp32 master copy of `p` parameters on one of `n` ranks; 0 with --adam_offload."""
    if t.adam_offload:
        return 0
    master = 4 if t.zero_stage >= 1 or t.dtype_bytes < 4 else 0
    return (8 + master) * p // (n if t.zero_stage >= 1 else 1)


def pass_bytes(model: Model, p: Pass, n: int, t: Training) -> Breakdown:
    """The transient memory of one pass: activations, logits, a training pass's gradients and, at ZeRO-3, the
    flat buffer its parameter all-gathers fill (a prefetch bucket, 5e7 elements)."""
    s, b = model.shape, t.dtype_bytes
    tokens = -(-p.tokens // t.ring_size)
    out = {"activations": activation_bytes(s, tokens, p.longest, p.train, t),
           "logits": 0 if model.scalar_head else tokens * s.vocab * b * (2 if p.train else 1),
           "gradients": gradient_bytes(model.trainable_params, n, t) if p.train and model.trained else 0}
    if model.partitioned(t):  # the all-gather's flat buffer of a prefetch bucket while parameters are fetched
        out["buffers"] = int(min(model.params, ZERO3_PREFETCH_ELEMENTS) * b)
    return out


def block_bytes_per_token(s: ModelShape, b: int) -> int:
    """What autograd keeps per token in one Llama block (module docstring)."""
    q = s.heads * s.head_dim
    return 2 * (8 + b) * s.hidden + b * (3 * q + 2 * s.kv_dim) + 4 * b * s.intermediate


def activation_bytes(s: ModelShape, tokens: int, longest: int, train: bool, t: Training) -> int:
    """Activations of one micro-batch of `tokens` tokens on one rank (already split over the ring): every
    block's with autograd, the block input of each plus one block's without recomputation under gradient
    checkpointing, one block's working set in a forward without autograd."""
    b = t.dtype_bytes
    block = block_bytes_per_token(s, b) * tokens
    if t.eager_attention:  # scores and probabilities of every head, per sequence of `longest` tokens
        block += 2 * b * s.heads * longest * -(-longest // t.ring_size) * max(1, tokens // longest)
    embeddings = tokens * s.hidden * b * 2  # the embedding output and the final norm's
    if not train:
        return block + embeddings
    if t.gradient_checkpointing:
        return s.layers * tokens * s.hidden * b + 2 * block + embeddings
    return s.layers * block + embeddings


def rollout_bytes(r: Rollout, b: int, stage: str, device_bytes: int | None) -> Breakdown:
    """The rollout engine's weights and KV cache on one rank in `stage` (with sleep none in experience and
    training: it wakes for the weight sync before generating)."""
    if r.sleep and stage in ("experience", "train"):
        return {}
    weights = r.shape.params() * b // r.tp
    if not r.vllm:
        kv = 2 * r.shape.layers * r.shape.kv_dim * b * r.tokens_per_rank if stage == "generation" else 0
        return {"rollout_weights": weights, "kv_cache": kv}
    if device_bytes is not None:  # vLLM on CUDA takes its fraction of the device: weights, KV and its activations
        return {"rollout_weights": weights, "kv_cache": max(0, int(r.gpu_fraction * device_bytes) - weights)}
    return {"rollout_weights": weights, "kv_cache": r.kv_cache_bytes}


def with_training(job: JobMemory, **changes) -> JobMemory:
    """`job` with other engine settings (what the report's suggestions try)."""
    return replace(job, training=replace(job.training, **changes))
