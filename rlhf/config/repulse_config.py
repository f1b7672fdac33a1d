"""RePULSe's sub-config of `train_ppo` (../shared/design/REPULSE.md), with the research fork's flag names
and defaults: the proposal q (`--actor_loss_type ctl`, `--actor_learning_rate`), the policy's update
(`--harmlessness_training_loss_type`, `--alpha`, `--base_actor_learning_rate`), the target's temperature
(`--target_dist_beta`), the reward transforms, the schedule and the analytic evaluation. Off unless
`--do_harmlessness_training`. This module knows nothing of argparse or of the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhf.config.shared_config import opt, require

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
