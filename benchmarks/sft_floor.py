"""A plain-PyTorch SFT step done well, as a floor for `train_sft`'s step time: the same rows, global batches and
token-budget micro-batches as `train_sft --packing_samples --use_dynamic_batch` (the product's sample loading,
sampler and micro-batch split, so both see the same tokens in the same order), the same random-initialised weights,
and a hand-written Qwen2 forward over packed rows.

    python benchmarks/sft_floor.py --model DIR --dataset sft.jsonl --train_batch_size 16 \
        --max_tokens_per_micro_batch 8192 --steps 4 [--dtype bf16] [--peak_tflops 989] [--device cuda]

What "done well" means here: q/k/v and gate/up fused into one matmul each, varlen attention on the packed row
(PyTorch's built-in flash varlen kernel on bf16 CUDA, the exact per-sequence SDPA loop elsewhere: `rlhf.kernels`),
a chunked linear + cross-entropy that never holds the [tokens, vocabulary] logits and computes its gradients in the
forward pass, bf16 parameters with fp32 master weights and a fused AdamW (torch's `fused=True` on CUDA), gradient
clipping; batches prepared on the device before the clock starts. FLOPs come from `rlhf.core.throughput.ModelShape`
(the formula every job's perf/* metrics use). Prints one JSON line: tokens per step, seconds per step, tokens/s,
TFLOP/s, MFU (means over the steps after the first), each step's loss and the peak memory. Shape legend: N packed
tokens of a micro-batch, H query heads, K kv heads, D head dim, V vocabulary, E hidden size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlhf.kernels import varlen_attention  # noqa: E402

from rlhf.core.throughput import ModelShape, shape_of_pretrained  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_profile import profiled  # noqa: E402


class LinearCrossEntropy(torch.autograd.Function):
    """sum_n weight_n * -log softmax(h_n W^T)[target_n], over chunks of rows: one chunk's logits at a time, the
    gradients of h and W computed in the forward (the backward only scales them)."""

    @staticmethod
    def forward(ctx, h_NE, W_VE, targets_N, weights_N, chunk: int):
        loss = torch.zeros((), dtype=torch.float32, device=h_NE.device)
        dh_NE = torch.empty_like(h_NE)
        dW_VE = torch.zeros_like(W_VE)  # addmm_ accumulates each chunk in fp32 and rounds once
        for s in range(0, h_NE.shape[0], chunk):
            h = h_NE[s:s + chunk]
            logits = (h @ W_VE.T).float()
            lse = logits.logsumexp(-1)
            t, w = targets_N[s:s + chunk], weights_N[s:s + chunk]
            loss += (w * (lse - logits.gather(1, t[:, None]).squeeze(1))).sum()
            grad = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
            grad[torch.arange(len(t), device=t.device), t] -= 1.0
            grad = (grad * w[:, None]).to(h.dtype)
            dh_NE[s:s + chunk] = grad @ W_VE
            dW_VE.addmm_(grad.T, h)
        ctx.save_for_backward(dh_NE, dW_VE)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        dh_NE, dW_VE = ctx.saved_tensors
        return dh_NE * grad_loss.to(dh_NE.dtype), dW_VE * grad_loss.to(dW_VE.dtype), None, None, None


def rope_cos_sin(position_N: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos, sin [N, 1, D] of rotary embeddings (the half-split convention of HF Llama/Qwen2)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=position_N.device, dtype=torch.float32) / head_dim)
    freqs = position_N.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x_NHD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x_NHD.shape[-1] // 2
    rotated = torch.cat([-x_NHD[..., half:], x_NHD[..., :half]], dim=-1)
    return x_NHD * cos + rotated * sin


class Layer(torch.nn.Module):
    def __init__(self, E: int, H: int, K: int, inter: int, eps: float) -> None:
        super().__init__()
        self.H, self.K, self.D, self.eps = H, K, E // H, eps
        self.qkv = torch.nn.Linear(E, (H + 2 * K) * self.D, bias=True)
        self.o = torch.nn.Linear(H * self.D, E, bias=False)
        self.gate_up = torch.nn.Linear(E, 2 * inter, bias=False)
        self.down = torch.nn.Linear(inter, E, bias=False)
        self.norm1, self.norm2 = torch.nn.Parameter(torch.ones(E)), torch.nn.Parameter(torch.ones(E))

    def forward(self, x_NE, cos, sin, cu_seqlens, max_len: int):
        N = x_NE.shape[0]
        q, k, v = self.qkv(F.rms_norm(x_NE, self.norm1.shape, self.norm1, self.eps)).view(
            N, self.H + 2 * self.K, self.D).split([self.H, self.K, self.K], dim=1)
        attn = varlen_attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.contiguous(), cu_seqlens, max_len)
        x_NE = x_NE + self.o(attn.reshape(N, -1))
        gate, up = self.gate_up(F.rms_norm(x_NE, self.norm2.shape, self.norm2, self.eps)).chunk(2, dim=-1)
        return x_NE + self.down(F.silu(gate) * up)


class Qwen2Floor(torch.nn.Module):
    """A Qwen2 causal LM (tied embeddings) over one packed row, loaded from an HF checkpoint of the same shape."""

    def __init__(self, config, checkpointing: bool) -> None:
        super().__init__()
        c = config
        self.embed = torch.nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = torch.nn.ModuleList(
            Layer(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size, c.rms_norm_eps)
            for _ in range(c.num_hidden_layers))
        self.norm = torch.nn.Parameter(torch.ones(c.hidden_size))
        self.eps, self.theta = c.rms_norm_eps, float(getattr(c, "rope_theta", None)
                                                       or c.rope_parameters["rope_theta"])
        self.checkpointing = checkpointing
        assert c.tie_word_embeddings, "the floor models the Qwen2.5 shapes: tied input and output embeddings"

    def load_hf(self, state: dict[str, torch.Tensor]) -> None:
        own = {"embed.weight": state["model.embed_tokens.weight"], "norm": state["model.norm.weight"]}
        for i in range(len(self.layers)):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            own |= {f"layers.{i}.qkv.weight": torch.cat([state[a + f"{n}_proj.weight"] for n in "qkv"]),
                    f"layers.{i}.qkv.bias": torch.cat([state[a + f"{n}_proj.bias"] for n in "qkv"]),
                    f"layers.{i}.o.weight": state[a + "o_proj.weight"],
                    f"layers.{i}.gate_up.weight": torch.cat([state[m + f"{n}_proj.weight"] for n in ("gate", "up")]),
                    f"layers.{i}.down.weight": state[m + "down_proj.weight"],
                    f"layers.{i}.norm1": state[p + "input_layernorm.weight"],
                    f"layers.{i}.norm2": state[p + "post_attention_layernorm.weight"]}
        self.load_state_dict(own, strict=True)

    def loss(self, batch: dict, num_targets: float, chunk: int) -> torch.Tensor:
        """The micro-batch's target NLL sum over the step's target count (what `train_sft` minimises)."""
        x = self.embed(batch["ids_N"])
        cos, sin = rope_cos_sin(batch["positions_N"], self.layers[0].D, self.theta, x.dtype)
        for layer in self.layers:
            args = (x, cos, sin, batch["cu_seqlens"], batch["max_len"])
            x = (torch.utils.checkpoint.checkpoint(layer, *args, use_reentrant=False) if self.checkpointing
                 else layer(*args))
        h = F.rms_norm(x, self.norm.shape, self.norm, self.eps)
        nll = LinearCrossEntropy.apply(h, self.embed.weight, batch["targets_N"], batch["weights_N"], chunk)
        return nll / num_targets


def step_batches(args, tokenizer, device: torch.device) -> list[list[dict]]:
    """Each step's micro-batches as packed device tensors: `train_sft`'s samples, sampler (one data-parallel
    replica, --seed) and token-budget split (--packing_samples --use_dynamic_batch)."""
    from rlhf.data.sampler import DistributedBatchSampler
    from rlhf.data.sources import read_rows
    from rlhf.data.supervised_samples import SFTBatch, load_sft_samples
    from rlhf.models.layout import SequenceLayout
    from rlhf.models.micro_batches import MicroBatcher

    rows = read_rows(args.dataset, probs=None, split="train", max_samples=10**8, seed=args.seed, flag="--dataset")
    samples, _ = load_sft_samples(rows, tokenizer, input_key=args.input_key, output_key=args.output_key,
                                  input_template=args.input_template, apply_chat_template=False, multiturn=False,
                                  pretrain_mode=False, max_len=args.max_len)
    sampler = DistributedBatchSampler(len(samples), args.train_batch_size, 1, 0, args.seed)
    batcher = MicroBatcher(1, args.max_tokens_per_micro_batch, layout=SequenceLayout(packing=True))
    steps = []
    for _ in range(args.steps):
        chosen = [samples[i] for i in sampler.next()]
        split = batcher.split(SFTBatch.collate(chosen, tokenizer.pad_token_id).attention_mask_BT)
        steps.append([packed([chosen[r] for r in micro], device) for micro in split])
    return steps


def packed(samples: list, device: torch.device) -> dict:
    """One packed row: ids, positions restarting per sequence, next-token targets and 0/1 target weights (the
    sample's loss mask; 0 at each sequence's last token), cu_seqlens."""
    lengths = [len(s.input_ids) for s in samples]
    ids = torch.cat([s.input_ids for s in samples])
    targets = torch.cat([torch.cat([s.input_ids[1:], s.input_ids[:1]]) for s in samples])
    weights = torch.cat([torch.cat([s.loss_mask.float(), torch.zeros(1)]) for s in samples])
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    return {"ids_N": ids.to(device), "positions_N": torch.cat([torch.arange(n) for n in lengths]).to(device),
            "targets_N": targets.to(device), "weights_N": weights.to(device), "cu_seqlens": cu.to(device),
            "max_len": max(lengths), "lengths": torch.tensor(lengths)}


class MasterAdamW:
    """AdamW on fp32 master copies of the (bf16) parameters: grads cast up, clipped, stepped, copied back. With
    fp32 parameters the masters are the parameters themselves."""

    def __init__(self, params: list[torch.Tensor], lr: float, max_norm: float, fused: bool) -> None:
        self.params, self.max_norm = params, max_norm
        self.masters = [p if p.dtype == torch.float32 else p.detach().float().requires_grad_() for p in params]
        self.optimizer = torch.optim.AdamW(self.masters, lr=lr, betas=(0.9, 0.95), weight_decay=0.0,
                                           fused=fused or None, foreach=None if fused else True)

    def step(self) -> float:
        for m, p in zip(self.masters, self.params):
            if m is not p:
                m.grad = p.grad.float()
                p.grad = None
        norm = torch.nn.utils.clip_grad_norm_(self.masters, self.max_norm, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        lowp = [(p, m) for p, m in zip(self.params, self.masters) if m is not p]
        if lowp:
            torch._foreach_copy_([p.data for p, _ in lowp], [m.data for _, m in lowp])
        return float(norm)


def run(args) -> dict:
    from transformers import AutoConfig

    from rlhf.models.loading import load_tokenizer

    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    config = AutoConfig.from_pretrained(args.model, local_files_only=True)
    steps = step_batches(args, load_tokenizer(args.model), device)
    model = Qwen2Floor(config, args.gradient_checkpointing)
    model.load_hf({name: t for f in sorted(os.listdir(args.model)) if f.endswith(".safetensors")
                   for name, t in load_file(os.path.join(args.model, f)).items()})  # every shard
    model.to(device=device, dtype=dtype)
    optimizer = MasterAdamW(list(model.parameters()), args.learning_rate, args.max_norm, fused=device.type == "cuda")
    shape: ModelShape = shape_of_pretrained(args.model)
    seconds, losses, tokens, flops = [], [], [], []
    for number, micro_batches in enumerate(steps, 1):
        num_targets = float(sum(float(mb["weights_N"].sum()) for mb in micro_batches))
        sync(device)
        start = time.perf_counter()
        loss = 0.0
        with profiled(args.profile_out) if number == args.profile_step else nullcontext():
            for mb in micro_batches:
                micro = model.loss(mb, num_targets, args.ce_chunk)
                micro.backward()
                loss += micro.detach()
            optimizer.step()
        sync(device)
        seconds.append(time.perf_counter() - start)
        losses.append(float(loss))
        lengths = torch.cat([mb["lengths"] for mb in micro_batches])
        tokens.append(int(lengths.sum()))
        flops.append(shape.flops(lengths, training=True))
    return summarize(args, shape, seconds, losses, tokens, flops, steps, device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def summarize(args, shape, seconds, losses, tokens, flops, steps, device) -> dict:
    """Means over the steps after the first (its start-up costs are not throughput), as `--perf` does."""
    timed = slice(1, None) if len(seconds) > 1 else slice(None)
    step_s = statistics.fmean(seconds[timed])
    tflops = statistics.fmean(f / s for f, s in zip(flops[timed], seconds[timed])) / 1e12
    tokens_per_s = statistics.fmean(t / s for t, s in zip(tokens[timed], seconds[timed]))
    out = {"steps": len(seconds), "tokens_per_step": tokens, "micro_batches_per_step": [len(m) for m in steps],
           "time_step_s": step_s, "tokens_per_s": tokens_per_s,
           "tflops": tflops, "mfu": tflops / args.peak_tflops if args.peak_tflops else None,
           "losses": losses, "params_N": shape.params, "dtype": args.dtype,
           "attention": "torch flash varlen" if device.type == "cuda" and args.dtype == "bf16" else "per-sequence SDPA",
           "adamw": "fused" if device.type == "cuda" else "foreach", "device": str(device)}
    if device.type == "cuda":
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        out["gpu"] = torch.cuda.get_device_name(device)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="an HF Qwen2 directory with tied embeddings")
    parser.add_argument("--dataset", required=True, help="SFT JSONL rows (as train_sft's --dataset)")
    parser.add_argument("--input_key", default="input")
    parser.add_argument("--output_key", default="output")
    parser.add_argument("--input_template", default="{} ")
    parser.add_argument("--max_len", type=int, default=2048)
    parser.add_argument("--train_batch_size", type=int, required=True)
    parser.add_argument("--max_tokens_per_micro_batch", type=int, required=True,
                        help="train_sft's --train_max_tokens_per_gpu")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seed", type=int, default=42, help="train_sft's --seed (the sampler's order)")
    parser.add_argument("--learning_rate", type=float, default=1e-5)
    parser.add_argument("--max_norm", type=float, default=1.0)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--ce_chunk", type=int, default=4096, help="rows per chunk of the linear + cross-entropy")
    parser.add_argument("--peak_tflops", type=float, default=None, help="one device's peak, for MFU")
    parser.add_argument("--profile_step", type=int, default=None, help="profile this step (1 = the first; "
                        "benchmarks/step_profile.py) and write its summary to --profile_out")
    parser.add_argument("--profile_out", default="floor_profile.json")
    args = parser.parse_args(argv)
    if args.peak_tflops is None and args.device.startswith("cuda"):
        from rlhf.core.throughput import device_peak_tflops

        args.peak_tflops = device_peak_tflops(torch.device(args.device), None)[0]
    torch.manual_seed(args.seed)
    print(json.dumps(run(args)), flush=True)


if __name__ == "__main__":
    main()
