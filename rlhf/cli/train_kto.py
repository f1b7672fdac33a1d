"""Entry point of KTO: `torchrun ... -m rlhf.cli.train_kto --pretrain ... --dataset ...` (or srun), with OpenRLHF
v0.9.5's train_kto flags: responses labelled desirable or undesirable (--input_key --output_key --label_key;
rows with --chosen_key/--rejected_key instead are pairs, split into one of each), --beta and the two loss
weights. The reference policy is placed as in train_dpo. Without --pretrain: the embedded tiny model on the
embedded pairs, split. The policy is written in HF format to --save_path.
"""

from __future__ import annotations

from rlhf.cli.entry_point import main_for
from rlhf.cli.supervised_run import Built, SupervisedJob, run_supervised, save_trained_model
from rlhf.cli.train_dpo import check_reference, reference_plan, with_reference
from rlhf.cli.train_sft import SFT_JOB
from rlhf.config.preference_config import TrainKTOConfig
from rlhf.core.loop import Job
from rlhf.data.supervised_samples import load_unpaired_samples
from rlhf.trainers.preference_trainers import KTO_EVAL_SUMS, KTO_METRICS, KTOTrainer


def _samples(cfg: TrainKTOConfig, tokenizer, rows: list) -> list:
    d = cfg.data
    samples, _ = load_unpaired_samples(rows, tokenizer, input_key=d.input_key, output_key=d.output_key,
                                       label_key=d.label_key, chosen_key=d.chosen_key, rejected_key=d.rejected_key,
                                       input_template=d.input_template, apply_chat_template=d.apply_chat_template,
                                       max_len=d.max_len, tokenizer_chat_template=d.tokenizer_chat_template)
    return samples


def _trainer(cfg: TrainKTOConfig, b: Built) -> Job:
    return with_reference(cfg, b, lambda reference: KTOTrainer(
        *b.trainer_args, reference=reference, beta=cfg.beta, desirable_weight=cfg.desirable_loss_weight,
        undesirable_weight=cfg.undesirable_loss_weight, max_len=cfg.data.max_len), KTO_METRICS, KTO_EVAL_SUMS)


KTO_JOB = SupervisedJob(
    name="kto", samples=_samples, load_model=SFT_JOB.load_model, make_trainer=_trainer, save=save_trained_model,
    bar={"loss": "kto_loss", "kl": "kl"}, check=check_reference, plan=reference_plan,
    demo_line="no --pretrain given: KTO of the embedded tiny demo model on its pairs, split into labelled answers")


def main(argv: list[str] | None = None) -> None:
    main_for(TrainKTOConfig, lambda cfg, w: run_supervised(KTO_JOB, cfg, w), "python -m rlhf.cli.train_kto", argv)


if __name__ == "__main__":
    main()
