"""One step of supervised fine-tuning (`train_sft`): this data-parallel rank's share of the global batch,
cut into micro-batches, next-token NLL summed over target tokens and divided by the target count of the
whole global batch (OpenRLHF's token-level mean), one optimizer step. Also the held-out NLL.

A `rlhf.core.loop.Job`: the loop, checkpoints and metric reductions are the core's. Knows the model
wrapper, the sampler and the batch record; nothing about launchers or flags.
"""

from __future__ import annotations

import torch.distributed as dist

from rlhf.algorithms.sft_loss import nll_over_global_count
from rlhf.core.accumulate import MicroLoss, global_counts, optimizer_step, step_metrics
from rlhf.core.metrics import Reduce
from rlhf.data.supervised_samples import SFTBatch
from rlhf.models.lm_logprobs import policy_forward
from rlhf.trainers.supervised_trainer import MODEL, SupervisedTrainer

SFT_METRICS = {"gpt_loss": Reduce.SHARE, "aux_loss": Reduce.SHARE, "grad_norm": Reduce.LEAD, "lr": Reduce.LEAD,
               "nonfinite_skipped": Reduce.LEAD}


class SFTTrainer(SupervisedTrainer):
    """SFT on the ranks of `MODEL` (every rank). Construct on every rank with the same samples."""

    batch_type = SFTBatch
    metrics = SFT_METRICS
    eval_sums = (2,)

    def __init__(self, *args, aux_loss_coef: float = 0.0) -> None:
        super().__init__(*args)
        self.aux_loss_coef = aux_loss_coef

    def step(self, step: int) -> dict[str, float]:
        with self.timer.stage("train"):
            micro_batches = self.next_micro_batches(step)
            ring = self.batcher.layout.ring_size
            (num_tokens,) = global_counts([sum(float(m.loss_mask_BT1.sum()) for m in micro_batches)], self.group,
                                          ring)
            num_micro = len(micro_batches) * dist.get_world_size(self.group)  # the aux loss: per rank's tokens
            num_replica_micro = len(micro_batches) * self.topology.dp_size(MODEL)  # its logged mean

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
        return self.reduced(stats)

    def eval_scores(self, items: list[SFTBatch]):
        """Held-out NLL sum and target-token count of each micro-batch."""
        for micro in items:
            out = policy_forward(self.model.engine, micro.input_ids_BT.to(self.device),
                                 micro.attention_mask_BT.to(self.device), layout=self.batcher.layout)
            mask = micro.loss_mask_BT1.to(self.device)
            yield -(out.logprobs_BT1 * mask).sum(), mask.sum()

    def eval_metrics(self, totals: list[float]) -> dict[str, float]:
        """Token-mean NLL of the held-out samples."""
        nll_sum, count = totals
        return {"eval_gpt_loss": nll_sum / max(count, 1.0)}
