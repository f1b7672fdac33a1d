"""RePULSe's run (`RepulseRun`, and `run`), built on PPO's (`rlhf.trainers.ppo_run.PPORun`): PPO with the fork's
evaluations and sample counts, or, with --do_harmlessness_training, RePULSe (a proposal q learns sigma ∝ p·exp(beta·r);
the policy is trained away from q's weighted samples) and its baselines (README.md, RePULSe section). The final
models go to --save_path (`model`, and `proposal` when q exists). Its entry point is `rlhf.cli.train_repulse`.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Sequence

from rlhf.core.run import Started, run_job
from rlhf.data.prompts import Prompt, load_prompts
from rlhf.repulse.repulse_config import TrainRepulseConfig
from rlhf.repulse.repulse_eval import AnalyticEvaluator, HeldoutEvaluator, the_single_prompt
from rlhf.repulse.repulse_trainer import PROPOSAL, RepulseTrainer, describe_repulse
from rlhf.trainers.async_ppo_trainer import AsyncPPOTrainer
from rlhf.trainers.ppo_build import EngineInputs, build_policy, describe_generation
from rlhf.trainers.ppo_run import PPORun
from rlhf.trainers.ppo_trainer import PPOTrainer, Roles
from rlhf.trainers.prompt_eval import prompt_unit
from rlhf.trainers.run_records import RunRecords


class RepulseRun(PPORun):
    """PPO's run with the fork's single prompt, evaluations, sample records and, for RePULSe, the proposal."""

    proposal = None

    def train_prompts(self, cfg: TrainRepulseConfig, tokenizer) -> list[Prompt]:
        if cfg.repulse.new_custom_single_prompt:  # the toy: one prompt, every step
            return [the_single_prompt(cfg, tokenizer)] * cfg.batch.rollout_batch_size
        return super().train_prompts(cfg, tokenizer)

    def eval_prompts(self, cfg: TrainRepulseConfig, tokenizer) -> dict[str, list[Prompt]]:
        """PPO's, and "heldout" (--heldout_prompt_data) with --evaluate_heldout_sampling."""
        out = super().eval_prompts(cfg, tokenizer)
        rp = cfg.repulse
        if rp.evaluate_heldout_sampling:
            out["heldout"] = load_prompts(dataclasses.replace(cfg.data, prompt_data=rp.heldout_prompt_data,
                                                              prompt_data_probs=None, input_key=rp.heldout_input_key),
                                          tokenizer,
                                          "--heldout_prompt_data")
        return out

    def algorithm_line(self, run: Started) -> str:
        if run.cfg.repulse.do_harmlessness_training:
            return f"{describe_repulse(run.cfg)}, {describe_generation(run.cfg.rollout)}"
        return super().algorithm_line(run)

    def evaluators(self, run: Started, roles: Roles, steps: int) -> list:
        """PPO's, and the fork's after every fit step: the exact log P(bad) (--analytic_bad_word_calc) and the
        held-out sampling (--evaluate_heldout_sampling)."""
        cfg, topology = run.cfg, run.topology
        out = super().evaluators(run, roles, steps)
        fit_step = self.sampler.steps_per_episode * cfg.episodes_per_fit_step
        if cfg.repulse.analytic_bad_word_calc:
            prompt = the_single_prompt(cfg, self.tokenizer)
            exp = roles.experience
            ref_layout = exp.ref_batcher.layout if exp.ref_batcher is not None else None
            analytic = AnalyticEvaluator(cfg, self.tokenizer, prompt.text, list(prompt.token_ids), prompt.label,
                                         exp.reward, exp.ref_model, ref_layout,
                                         roles.actor.model.module.config.vocab_size, period=fit_step)
            if topology.rank == 0:
                print(analytic.describe(), flush=True)
            out.append(analytic)
        if "heldout" in self.prompts_for_eval:
            out.append(HeldoutEvaluator(cfg, self.prompts_for_eval["heldout"], cfg.logging.save_path,
                                        topology.rank == 0, prompt_unit(topology), period=fit_step))
        return out

    def make_trainer(self, run: Started, roles: Roles, engine, steps: int) -> PPOTrainer:
        cfg, topology, rp = run.cfg, run.topology, run.cfg.repulse
        records = RunRecords(topology.rank == 0,
                             negdata_path=os.path.join(cfg.logging.save_path, "negdata.jsonl") if rp.save_negdata
                             else None, negdata_threshold=rp.save_negdata_threshold,
                             info_path=os.path.join(rp.save_info_path, "evaluations.jsonl") if rp.save_info_path
                             else None)
        common = dict(evaluators=self.evaluators(run, roles, steps), agent=self.agent, records=records,
                      rm_max_len=rp.rm_max_len)
        args = (cfg, topology, roles, engine, self.sampler, self.tokenizer, run.device)
        if not rp.do_harmlessness_training:
            return (AsyncPPOTrainer if cfg.rollout.async_train else PPOTrainer)(*args, **common)
        if PROPOSAL in topology.plan and topology.hosts(PROPOSAL):  # --actor_learning_rate is q's (fork names)
            self.proposal = build_policy(EngineInputs.of(cfg, steps), cfg.algo, cfg.rollout.temperature, topology,
                                         PROPOSAL, run.device, cfg.optim.actor_learning_rate,
                                         updates_per_batch=cfg.batch.num_episodes)
        return RepulseTrainer(*args, proposal=self.proposal, **common)

    def save(self, run: Started, roles: Roles) -> None:
        """PPO's models, and the proposal q beside the policy."""
        super().save(run, roles)
        if self.proposal is not None:
            self.proposal.model.save_hf(os.path.join(run.cfg.logging.save_path, "proposal"), self.tokenizer,
                                        run.topology.leads(PROPOSAL))


def run(cfg: TrainRepulseConfig, parse_warnings: Sequence[warnings.WarningMessage] = ()) -> None:
    run_job(RepulseRun(), cfg, parse_warnings)
