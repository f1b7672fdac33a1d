"""One step of supervised fine-tuning (`train_sft`): this data-parallel rank's share of the global batch,
cut into micro-batches, next-token NLL summed over target tokens and divided by the target count of the
whole global batch (OpenRLHF's token-level mean), one optimizer step. Also the held-out NLL.

A `rlhf.train.loop.Job`: the loop, checkpoints and metric reductions are the core's. Knows the model
wrapper, the sampler and the batch record; nothing about launchers or flags.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlhf.algorithms.sft import nll_over_global_count
from rlhf.data.sampler import DistributedBatchSampler
from rlhf.data.supervised import SFTBatch, SFTSample
from rlhf.distributed.topology import Role, Topology
from rlhf.engines.deepspeed_engine import DeepSpeedModel
from rlhf.models.logprobs import policy_forward
from rlhf.models.micro_batches import MicroBatcher
from rlhf.train.accumulate import MicroLoss, global_counts, optimizer_step, step_metrics
from rlhf.train.metrics import Reduce, reduce_metrics
from rlhf.train.state import CheckpointedState
from rlhf.utils.timers import StageTimer

SFT_METRICS = {"gpt_loss": Reduce.SHARE, "aux_loss": Reduce.SHARE, "grad_norm": Reduce.LEAD, "lr": Reduce.LEAD,
               "nonfinite_skipped": Reduce.LEAD}


class SFTTrainer:
    """SFT on the ranks of `Role.ACTOR` (every rank). Construct on every rank with the same samples."""

    def __init__(self, model: DeepSpeedModel, topology: Topology, samples: list[SFTSample],
                 eval_samples: list[SFTSample], sampler: DistributedBatchSampler, batcher: MicroBatcher,
                 tokenizer, device: torch.device, aux_loss_coef: float = 0.0) -> None:
        self.model, self.topology, self.samples, self.eval_samples = model, topology, samples, eval_samples
        self.sampler, self.batcher, self.tokenizer, self.device = sampler, batcher, tokenizer, device
        self.aux_loss_coef = aux_loss_coef
        self.group = topology.group(Role.ACTOR)
        self.timer = StageTimer()

    def _micro_batches(self, indices: list[int]) -> list[SFTBatch]:
        batch = SFTBatch.collate([self.samples[i] for i in indices], self.tokenizer.pad_token_id)
        return [batch.select(torch.tensor(rows)).trimmed() for rows in self.batcher.split(batch.attention_mask_BT)]

    def step(self, step: int) -> dict[str, float]:
        assert self.sampler.step == step, f"sampler at step {self.sampler.step}, loop at {step}"
        with self.timer.stage("train"):
            micro_batches = self._micro_batches(self.sampler.next())
            ring = self.batcher.layout.ring_size
            (num_tokens,) = global_counts([sum(float(m.loss_mask_BT1.sum()) for m in micro_batches)], self.group,
                                          ring)
            num_micro = len(micro_batches) * dist.get_world_size(self.group)  # the aux loss: per rank's tokens
            num_replica_micro = len(micro_batches) * self.topology.dp_size(Role.ACTOR)  # its logged mean

            def micro_loss(batch: SFTBatch) -> MicroLoss:
                out = policy_forward(self.model.engine, batch.input_ids_BT.to(self.device),
                                     batch.attention_mask_BT.to(self.device), layout=self.batcher.layout)
                nll = nll_over_global_count(out.logprobs_BT1, batch.loss_mask_BT1.to(self.device), num_tokens)
                terms, loss = {"gpt_loss": nll}, nll
                if out.aux_loss is not None and self.aux_loss_coef:
                    terms["aux_loss"] = out.aux_loss / num_replica_micro
                    loss = loss + self.aux_loss_coef * out.aux_loss / num_micro
                return MicroLoss(loss, terms)

            stats = step_metrics(self.model, optimizer_step(self.model, micro_batches, micro_loss))
        return reduce_metrics({Role.ACTOR: stats}, SFT_METRICS, self.topology)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Token-mean NLL of the held-out samples (each DP replica scores its share). Collective over the world."""
        if not self.eval_samples:
            return {}
        self.model.eval()
        dp, rank = self.topology.dp_size(Role.ACTOR), self.topology.dp_rank(Role.ACTOR)
        mine = list(range(rank, len(self.eval_samples), dp))
        nll_sum = count = 0.0
        if mine:
            batch = SFTBatch.collate([self.eval_samples[i] for i in mine], self.tokenizer.pad_token_id)
            for rows in self.batcher.split(batch.attention_mask_BT):
                micro = batch.select(torch.tensor(rows)).trimmed()
                out = policy_forward(self.model.engine, micro.input_ids_BT.to(self.device),
                                     micro.attention_mask_BT.to(self.device), layout=self.batcher.layout)
                mask = micro.loss_mask_BT1.to(self.device)
                nll_sum += float(-(out.logprobs_BT1 * mask).sum())
                count += float(mask.sum())
        shares = self.topology.ring_rank(Role.ACTOR) == 0  # the ranks of a ring score the same samples
        totals = torch.tensor([nll_sum, count] if shares else [0.0, 0.0], dtype=torch.float64)
        dist.all_reduce(totals)
        return {"eval_gpt_loss": float(totals[0] / totals[1].clamp(min=1))}

    def checkpointed(self) -> CheckpointedState:
        def hf(directory: str) -> None:
            self.model.save_hf(directory, self.tokenizer, self.topology.leads(Role.ACTOR))

        return CheckpointedState(engines={"model": self.model}, components={"sampler": self.sampler}, hf_export=hf)
