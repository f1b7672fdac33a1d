"""RePULSe's config (README.md, RePULSe section): `TrainRepulseConfig`, `train_ppo`'s config with the research
fork's flags (the fork's `train_ppo` runs PPO and RePULSe), read by `python -m rlhf.cli.train_repulse`. Its
sub-config `RepulseConfig` carries the fork's flag names and defaults: the proposal q (`--actor_loss_type ctl`,
`--actor_learning_rate`), the policy's update (`--harmlessness_training_loss_type`, `--alpha`,
`--base_actor_learning_rate`), the target's temperature (`--target_dist_beta`), the reward transforms, the
schedule and the evaluations. RePULSe is off unless `--do_harmlessness_training`. This module knows nothing of
argparse or of the trainer.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from typing import ClassVar

from rlhf.config.ppo_config import AlgoConfig, PlacementConfig, PPOOptimConfig, Schedule, TrainPPOConfig
from rlhf.config.shared_config import RolePlacement, opt, require, role_placement

FORK_IGNORED_FLAGS = {
    "rm_type": "the RePULSe fork's reward-model plumbing switch; rewards come from --reward_pretrain/--remote_rm_url",
    "n_seeds_f_q": "the RePULSe fork's F_q test-info bookkeeping, not part of training",
    "no_test_info": "the RePULSe fork's F_q test-info bookkeeping, not part of training",
    "test_info_every": "the RePULSe fork's F_q test-info bookkeeping, not part of training",
}
"""The fork's own bookkeeping flags (its `train_ppo` and `evaluate_gcg`): accepted with a note, nothing to do here."""
FORK_IGNORED_SWITCHES = frozenset({"no_test_info"})

LOSS_TYPES = ("neg_training", "reinforce")
REWARD_TRANSFORMS = ("minus_alpha_exp_beta_r", "minus_alpha_ind")


@dataclass(frozen=True, kw_only=True)
class RepulseConfig:
    """RePULSe: q (the proposal, a second trainable copy of the policy) learns sigma ∝ p·exp(beta·r) by CTL;
    p is trained by REINFORCE (leave-one-out baseline) and pushed away from q's weighted samples."""

    do_harmlessness_training: bool = opt(False, "train the policy with RePULSe (or its baselines) instead of PPO")
    harmlessness_training_loss_type: str | None = opt(None, "the policy's loss with --do_harmlessness_training "
                                                      "(required there): neg_training (REINFORCE + alpha x weighted "
                                                      "negatives) or reinforce (REINFORCE alone)")
    alpha: float = opt(0.5, "weight of the negative term (effective weight alpha / K, as in the fork)")
    target_dist_beta: float | None = opt(None, "beta of sigma ∝ p·exp(beta·r) (negative: toward low rewards); "
                                         "needed by q, --use_base_as_proposal and minus_alpha_exp_beta_r")
    base_actor_learning_rate: float = opt(1e-6, "the policy's learning rate with --do_harmlessness_training "
                                          "(--actor_learning_rate is then q's)")
    actor_loss_type: str = opt("ppo", "ppo (the policy's PPO loss, without --do_harmlessness_training); with it "
                               "the proposal's loss: ctl (contrastive twist learning) or dpg (distributional policy "
                               "gradient)")
    parameterization: str = opt("policy", "policy (PPO's policy); with --do_harmlessness_training the proposal's: "
                                "policy_psi_q_p_s_t (q is a full policy; log psi = log q - log p)")
    reinforce_baseline_type: str | None = opt(None, "baseline of the policy's REINFORCE with "
                                              "--do_harmlessness_training (required there): expectation "
                                              "(leave-one-out mean of the group's returns)")
    duplicate_rollout_batch_by: int = opt(1, "samples per prompt K (times --n_samples_per_prompt)")
    harmlessness_training_num_episodes: int = opt(1, "episodes of q-then-p steps in each fit step")
    fit_steps: int = opt(1, "outer repeats of the episodes (--harmlessness_training_num_episodes with "
                         "--do_harmlessness_training, else --num_episodes), evaluated after each")
    reward_transform: str | None = opt(None, "transform of the policy samples' rewards: minus_alpha_exp_beta_r "
                                       "(r - a·exp(b·r)) or minus_alpha_ind (r - a·1[r < --threshold])")
    rew_trans_alpha: float | None = opt(None, "a of the reward transform (default: --alpha)")
    rew_trans_beta: float | None = opt(None, "b of minus_alpha_exp_beta_r (default: --target_dist_beta)")
    threshold: float = opt(-5.0, "reward threshold of minus_alpha_ind and of the held-out P(r < threshold)")
    use_base_as_proposal: bool = opt(False, "no q: the policy's own samples are the negatives, weighted by "
                                     "softmax(beta·r) within the group")
    analytic_bad_word_calc: bool = opt(False, "after every fit step log the exact log P(bad) of 2-token responses "
                                       "to the single prompt (the bad words: --bad_words, or the reward file's "
                                       "BAD_WORDS)")
    new_custom_single_prompt: bool = opt(False, "train on one prompt: --custom_prompt, else the one prompt of "
                                         "--prompt_data (the toy setting)")
    custom_prompt: str | None = opt(None, "the single prompt of --new_custom_single_prompt / the analytic "
                                    "evaluation (default: the one prompt of --prompt_data)")
    bad_words: str | None = opt(None, "space-separated words, each one token, that make a response bad "
                                "(the set B of the analytic P(bad); default: BAD_WORDS of the --remote_rm_url file)")
    evaluate_heldout_sampling: bool = opt(False, "after every fit step sample K responses per held-out prompt "
                                          "from the policy: save each one's reward, return and KL, report the mean "
                                          "return, P(r < --threshold) and the CVaR")
    heldout_prompt_data: str | None = opt(None, "held-out prompts (a local JSON/JSONL file or directory)")
    heldout_input_key: str = opt("input", "dataset column of the held-out prompts")
    sampling_iters: int = opt(1, "rounds of K samples per held-out prompt in each held-out evaluation")
    save_negdata: bool = opt(False, "append every sampled response (policy and proposal) whose reward is below "
                             "--save_negdata_threshold to SAVE_PATH/negdata.jsonl")
    save_negdata_threshold: float = opt(-10000.0, "reward below which --save_negdata keeps a response")
    rm_max_len: int | None = opt(None, "reward models see at most this many tokens of each sample (prompt and "
                                 "response; default: all of them)")
    save_steps_harmless: int = opt(-1, "write a checkpoint every N RePULSe steps (-1: --save_steps decides)")
    save_info_path: str | None = opt(None, "also append each evaluation's row to DIR/evaluations.jsonl (the fork "
                                     "defaults to ./info; here nothing is written unless given)")
    heldout_cvar_fraction: float = opt(0.01, "the worst fraction of held-out rewards the CVaR averages (not a fork "
                                       "flag)")

    def __post_init__(self) -> None:
        if self.do_harmlessness_training:
            self._check_harmlessness()
        else:
            require(self.actor_loss_type == "ppo" and self.parameterization == "policy",
                    f"--actor_loss_type {self.actor_loss_type} --parameterization {self.parameterization} trains a "
                    "proposal, which exists only with --do_harmlessness_training (training q alone, without the "
                    "policy, is not built): add --do_harmlessness_training, or use --actor_loss_type ppo "
                    "--parameterization policy for PPO")
        require(self.reward_transform is None or self.reward_transform in REWARD_TRANSFORMS,
                f"--reward_transform {self.reward_transform!r}: choose one of {', '.join(REWARD_TRANSFORMS)}")
        for name in ("duplicate_rollout_batch_by", "harmlessness_training_num_episodes", "fit_steps"):
            require(getattr(self, name) >= 1, f"--{name} must be >= 1")
        if self.evaluate_heldout_sampling:
            require(self.heldout_prompt_data is not None, "--evaluate_heldout_sampling needs --heldout_prompt_data")
        require(self.sampling_iters >= 1, "--sampling_iters must be >= 1")
        require(self.rm_max_len is None or self.rm_max_len >= 1, "--rm_max_len must be >= 1")
        require(self.save_steps_harmless == -1 or self.save_steps_harmless >= 1,
                "--save_steps_harmless must be -1 or >= 1")
        require(0 < self.heldout_cvar_fraction <= 1, "--heldout_cvar_fraction must lie in (0, 1]")

    def _check_harmlessness(self) -> None:
        require(self.harmlessness_training_loss_type in LOSS_TYPES,
                f"--harmlessness_training_loss_type {self.harmlessness_training_loss_type}: --do_harmlessness_training "
                f"needs one of {', '.join(LOSS_TYPES)}")
        require(self.reinforce_baseline_type == "expectation",
                f"--reinforce_baseline_type {self.reinforce_baseline_type}: --do_harmlessness_training needs "
                "--reinforce_baseline_type expectation (the leave-one-out mean; the only baseline built)")
        require(self.alpha >= 0, "--alpha must be >= 0")
        require(self.base_actor_learning_rate >= 0, "--base_actor_learning_rate must be >= 0")
        if self.uses_proposal:
            require(self.actor_loss_type in ("ctl", "dpg"), f"--actor_loss_type {self.actor_loss_type}: the "
                    "proposal trains with ctl or dpg (add --actor_loss_type ctl)")
            require(self.parameterization == "policy_psi_q_p_s_t", f"--parameterization {self.parameterization}: "
                    "the proposal is built as policy_psi_q_p_s_t only (add --parameterization policy_psi_q_p_s_t)")
        needs_beta = {"the proposal's target sigma": self.uses_proposal,
                      "--use_base_as_proposal's weights": self.use_base_as_proposal and self.negatives_used}
        for what, needed in needs_beta.items():
            require(not needed or self.target_dist_beta is not None,
                    f"{what} need --target_dist_beta (e.g. -10: toward low rewards)")
        if self.reward_transform == "minus_alpha_exp_beta_r":
            require(self.transform_beta is not None, "--reward_transform minus_alpha_exp_beta_r needs "
                    "--rew_trans_beta or --target_dist_beta")

    @property
    def negatives_used(self) -> bool:
        """Whether the policy's loss has the negative term."""
        return self.do_harmlessness_training and self.harmlessness_training_loss_type == "neg_training"

    @property
    def uses_proposal(self) -> bool:
        """Whether q exists: the negative term needs q's samples unless the policy's own stand in."""
        return self.negatives_used and not self.use_base_as_proposal

    @property
    def transform_alpha(self) -> float:
        return self.alpha if self.rew_trans_alpha is None else self.rew_trans_alpha

    @property
    def transform_beta(self) -> float:
        return self.target_dist_beta if self.rew_trans_beta is None else self.rew_trans_beta


@dataclass(frozen=True, kw_only=True)
class RepulsePlacementConfig(PlacementConfig):
    """PPO's placement and the proposal's ranks."""

    proposal: RolePlacement = role_placement("proposal", "the proposal q's (not an OpenRLHF flag)",
                                             "0: on the actor's ranks")

    @property
    def by_role(self) -> dict[str, RolePlacement]:
        return {**super().by_role, "proposal": self.proposal}


@dataclass(frozen=True, kw_only=True)
class TrainRepulseConfig(TrainPPOConfig):
    """The RePULSe fork's `train_ppo`: PPO (with the fork's evaluations and sample counts) or, with
    --do_harmlessness_training, RePULSe and its baselines."""

    IGNORED_FLAGS: ClassVar[dict[str, str]] = {**TrainPPOConfig.IGNORED_FLAGS, **FORK_IGNORED_FLAGS}
    IGNORED_SWITCHES: ClassVar[frozenset[str]] = TrainPPOConfig.IGNORED_SWITCHES | FORK_IGNORED_SWITCHES

    placement: RepulsePlacementConfig = field(default_factory=RepulsePlacementConfig)
    repulse: RepulseConfig = field(default_factory=RepulseConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        rp = self.repulse
        if rp.do_harmlessness_training:  # then it is q's rate; 0 keeps q fixed (the fork's baseline commands)
            require(self.optim.actor_learning_rate >= 0, "--actor_learning_rate must be >= 0")
        self._check_repulse()
        self._check_evaluation()
        require(not (self.rollout.async_train and rp.do_harmlessness_training),
                "--async_train does not support --do_harmlessness_training: RePULSe's proposal samples inside the "
                "step, where the generation ranks are already a step ahead; drop one of them")
        require(not (self.agent.agent_func_path and rp.do_harmlessness_training),
                "--agent_func_path: multi-turn episodes are not supported with --do_harmlessness_training")

    @property
    def schedule(self) -> Schedule:
        """In a RePULSe run (--do_harmlessness_training): no PPO update and no critic, --save_steps_harmless (when
        given) for the checkpoint interval, the policy's rate from --base_actor_learning_rate (--actor_learning_rate
        is then q's; the fork's names), and the proposal q beside the policy when it is used. Always:
        --n_samples_per_prompt x --duplicate_rollout_batch_by samples per prompt (the fork's PPO runs use it too)
        and --fit_steps x the episodes of a fit step."""
        rp, ppo = self.repulse, super().schedule
        harmless = rp.do_harmlessness_training
        return replace(
            ppo, ppo_update=not harmless, uses_critic=ppo.uses_critic and not harmless,
            save_steps=rp.save_steps_harmless if harmless and rp.save_steps_harmless != -1 else ppo.save_steps,
            samples_per_prompt=self.rollout.n_samples_per_prompt * rp.duplicate_rollout_batch_by,
            samples_per_prompt_flags="--n_samples_per_prompt x --duplicate_rollout_batch_by",
            actor_learning_rate=rp.base_actor_learning_rate if harmless else ppo.actor_learning_rate,
            episodes=rp.fit_steps * self.episodes_per_fit_step,
            policy_copies=("proposal",) if rp.uses_proposal else ())

    @property
    def prompts_given(self) -> bool:
        return super().prompts_given or self.repulse.new_custom_single_prompt

    @property
    def episodes_per_fit_step(self) -> int:
        """Episodes between two evaluations of the fork's schedule: --harmlessness_training_num_episodes with
        --do_harmlessness_training (where --num_episodes counts q's updates per step), else --num_episodes."""
        rp = self.repulse
        return rp.harmlessness_training_num_episodes if rp.do_harmlessness_training else self.batch.num_episodes

    def _check_repulse_unused(self) -> None:
        """PPO settings RePULSe's step does not use (or has not built yet): refused when set, never ignored."""
        a, e, d = self.algo, self.engine, self.data
        defaults = AlgoConfig()
        unused = {
            "--use_kl_loss (RePULSe puts the k1 KL in the return)": a.use_kl_loss,
            "--kl_target (the KL coefficient is fixed)": a.kl_target is not None,
            "--entropy_loss_coef": a.entropy_loss_coef is not None,
            "--dynamic_filtering": a.dynamic_filtering,
            "--enable_vllm_is_correction": a.enable_vllm_is_correction,
            "--normalize_reward": a.normalize_reward,
            "--overlong_buffer_len": a.overlong_buffer_len is not None,
            "--stop_properly_penalty_coef": a.stop_properly_penalty_coef is not None,
            "--reward_clip_range": a.reward_clip_range != defaults.reward_clip_range,
            "--freezing_actor_steps": a.freezing_actor_steps != defaults.freezing_actor_steps,
            "--pretrain_data (the ptx loss)": d.pretrain_data is not None,
            "--use_dynamic_batch (not built for RePULSe yet)": e.use_dynamic_batch,
            "--ring_attn_size > 1 (not built for RePULSe yet)": e.ring_attn_size > 1,
            "--ds_tensor_parallel_size > 1 (not built for RePULSe yet)": e.ds_tensor_parallel_size > 1,
        }
        named = [flag for flag, is_set in unused.items() if is_set]
        require(not named, "--do_harmlessness_training does not use " + ", ".join(named) + ": drop "
                f"{'it' if len(named) == 1 else 'them'} (RePULSe's rewards are used as they come, without PPO's "
                "shaping)")

    def _check_repulse(self) -> None:
        """RePULSe (--do_harmlessness_training) runs REINFORCE-style updates on whole prompt groups."""
        rp, b = self.repulse, self.batch
        if not rp.do_harmlessness_training:
            return
        k = self.schedule.samples_per_prompt
        require(k > 1, "--do_harmlessness_training compares the samples of a prompt: --duplicate_rollout_batch_by "
                       "(times --n_samples_per_prompt) must be > 1")
        # A prompt's group may span micro-batches and ranks (advantages and weights are computed on whole groups
        # first); only CTL's per-position weights need the group's samples under the parameters of one step.
        require(not (rp.uses_proposal and rp.actor_loss_type == "ctl") or b.train_batch_size % k == 0,
                f"--train_batch_size {b.train_batch_size} must be a multiple of the {k} samples of a prompt with "
                "--actor_loss_type ctl: CTL weighs each position of a sample against the same position of the "
                "prompt's other samples under the proposal of the same optimizer step, so a group must not span "
                "two steps")
        require(self.placement.num_ranks("critic") == 0 and not self.model.critic_pretrain,
                "--do_harmlessness_training trains no critic: drop the critic flags")
        require(rp.uses_proposal or self.placement.num_ranks("proposal") == 0,
                "--proposal_num_gpus_per_node places a proposal, and this run trains none (reinforce or "
                "--use_base_as_proposal): drop it")
        self._check_repulse_unused()
        if rp.save_steps_harmless != -1:
            require(self.checkpoint.save_steps == -1, "--save_steps_harmless and --save_steps both set a checkpoint "
                    "interval: give one")
        if self.batch.max_epochs != 1:
            warnings.warn(f"--max_epochs {self.batch.max_epochs} is ignored with --do_harmlessness_training: "
                          "each batch gives one update of q and one of p, as in the fork", stacklevel=2)
        if not rp.uses_proposal and self.optim.actor_learning_rate not in (0, PPOOptimConfig().actor_learning_rate):
            why = "--use_base_as_proposal" if rp.use_base_as_proposal else \
                f"--harmlessness_training_loss_type {rp.harmlessness_training_loss_type}"
            warnings.warn(f"--actor_learning_rate {self.optim.actor_learning_rate:g} has no effect: it is the "
                          f"proposal's rate and {why} trains no proposal (the policy's is "
                          "--base_actor_learning_rate)", stacklevel=2)

    def _check_evaluation(self) -> None:
        """The fork's evaluation and sample-saving flags (PPO and RePULSe alike), and RePULSe-only flags set
        without --do_harmlessness_training."""
        rp = self.repulse
        if not rp.do_harmlessness_training:
            defaults = RepulseConfig()
            unused = [name for name in ("harmlessness_training_loss_type", "alpha", "target_dist_beta",
                                        "base_actor_learning_rate", "reinforce_baseline_type", "reward_transform",
                                        "rew_trans_alpha", "rew_trans_beta", "use_base_as_proposal",
                                        "harmlessness_training_num_episodes", "save_steps_harmless")
                      if getattr(rp, name) != getattr(defaults, name)]
            if unused:
                warnings.warn(", ".join(f"--{name}" for name in unused) + " only act with --do_harmlessness_training: "
                              "ignored in this PPO run", stacklevel=3)
        if rp.analytic_bad_word_calc:
            p = self.placement
            require(p.colocate_all_models or not any(p.num_ranks(r) for r in ("actor", "critic", "reward", "ref",
                                                                               "proposal")),
                    "--analytic_bad_word_calc evaluates on every rank: colocate the models (--colocate_all_models)")
            require(self.rollout.generate_max_len == 2, "--analytic_bad_word_calc is exact for 2-token responses: "
                    f"set --generate_max_len 2 (got {self.rollout.generate_max_len})")
            require(rp.new_custom_single_prompt or rp.custom_prompt is not None, "--analytic_bad_word_calc "
                    "evaluates one prompt: add --new_custom_single_prompt (the one prompt of --prompt_data) or "
                    "--custom_prompt TEXT")
        if rp.rm_max_len is not None and not self.reward.reward_paths:
            warnings.warn(f"--rm_max_len {rp.rm_max_len} has no effect: rewards come from --remote_rm_url (text), "
                          "not reward models", stacklevel=3)
