"""Entry point of reward-model training: `torchrun ... -m rlhf.cli.train_rm --pretrain ... --dataset ...`
(or srun), with OpenRLHF v0.9.5's train_rm flags. Without --pretrain: the embedded tiny model learns to
prefer the embedded copy-task pairs' chosen answers. The model is written to --save_path as a
sequence-classification checkpoint (loads in `AutoModelForSequenceClassification`, `train_ppo
--reward_pretrain` and `serve_rm`), with the held-out reward mean/std in its config.
"""

from __future__ import annotations

from rlhf.cli.entry_point import main_for
from rlhf.cli.supervised_run import Built, SupervisedJob, run_supervised, save_trained_model
from rlhf.config.supervised_config import TrainRMConfig
from rlhf.data.supervised_samples import load_pair_samples
from rlhf.models.value import load_scalar_head_model
from rlhf.trainers.rm_trainer import RewardModelTrainer


def _samples(cfg: TrainRMConfig, tokenizer, rows: list) -> list:
    d = cfg.data
    samples, _ = load_pair_samples(rows, tokenizer, prompt_key=d.prompt_key, chosen_key=d.chosen_key,
                                   rejected_key=d.rejected_key, margin_key="margin" if d.margin_loss else None,
                                   input_template=d.input_template, apply_chat_template=d.apply_chat_template,
                                   max_len=d.max_len, tokenizer_chat_template=d.tokenizer_chat_template)
    return samples


def _trainer(cfg: TrainRMConfig, b: Built) -> RewardModelTrainer:
    return RewardModelTrainer(*b.trainer_args, loss=cfg.loss, margin_loss=cfg.data.margin_loss)


RM_JOB = SupervisedJob(
    name="rm", samples=_samples,
    load_model=lambda cfg, attn: load_scalar_head_model(cfg.model.pretrain, cfg.model.value_head_prefix,
                                                        cfg.model.dtype, attn, cfg.model.trust_remote_code,
                                                        "--pretrain", fresh_head=True,
                                                        load_in_4bit=cfg.model.lora.load_in_4bit),
    make_trainer=_trainer, save=save_trained_model,
    bar={"loss": "loss", "acc": "acc"},
    demo_line="no --pretrain given: training a reward model from the embedded tiny demo model on its pairs")


def main(argv: list[str] | None = None) -> None:
    main_for(TrainRMConfig, lambda cfg, w: run_supervised(RM_JOB, cfg, w), "python -m rlhf.cli.train_rm", argv)


if __name__ == "__main__":
    main()
