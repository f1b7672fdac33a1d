"""RePULSe's updates with a prompt's group split over ranks and micro-batches take the step of one forward over
whole groups: 3 prompts x 4 samples on 2 ranks put the middle group on both ranks, and micro-batches of 6 or 2
split every group further. The proposal's CTL step (ZeRO-3; its per-position weights need the whole group, so the
split step scores the group first) and the policy's REINFORCE + negatives step (ZeRO-2) must equal the plain
AdamW step of the whole batch in one process (AdamW's bound, `tests.tiny_runs.assert_adam_weights_close`)."""

from __future__ import annotations

import torch

from tests.distributed import run_on_ranks

K, PROMPTS, LR, ALPHA = 4, 3, 1e-2, 0.5
SPLITS = (6, 2)
"""--micro_train_batch_size of each split run: 6 is a rank's whole share (one and a half groups), 2 half a group."""


def _samples(vocab: int):
    """(q's samples with their SNIS weights, p's samples with their advantages) as `GroupSamples`: 12 right-padded
    rows of a 3-token prompt and a 1-6 token response, p's and q's log-probs at sampling time, beta·r."""
    from rlhf.repulse import repulse_losses
    from rlhf.repulse.repulse_trainer import GroupSamples

    g = torch.Generator().manual_seed(5)
    B, T = K * PROMPTS, 9

    def rows():
        lengths = 3 + torch.randint(1, 7, (B,), generator=g)
        attn = (torch.arange(T)[None] < lengths[:, None]).long()
        seq = torch.randint(4, vocab, (B, T), generator=g) * attn
        action = (attn[:, 1:] * (torch.arange(1, T)[None] >= 3)).float()
        return seq, attn, action

    seq, attn, action = rows()
    logp = -torch.rand(B, T - 1, generator=g) * 3 * action
    logq_old = -torch.rand(B, T - 1, generator=g) * 3 * action
    beta_r = torch.randn(B, generator=g)
    w_sigma = repulse_losses.snis_weights_PK(repulse_losses.masked_sum_PK(logp, action).reshape(PROMPTS, K),
                                             beta_r.reshape(PROMPTS, K),
                                             repulse_losses.masked_sum_PK(logq_old, action).reshape(PROMPTS, K))
    negatives = GroupSamples(seq, attn, action, w_sigma.reshape(-1), logq_old, logp, beta_r)
    seq, attn, action = rows()
    advantages = torch.randn(B, generator=g)
    zeros = torch.zeros(B, T - 1)
    positives = GroupSamples(seq, attn, action, advantages, zeros, zeros, zeros[:, 0])
    return negatives, positives


def _repulse_config(micro: int):
    from types import SimpleNamespace

    from rlhf.repulse.repulse_config import RepulseConfig

    repulse = RepulseConfig(do_harmlessness_training=True, duplicate_rollout_batch_by=K, alpha=ALPHA,
                            harmlessness_training_loss_type="neg_training", reinforce_baseline_type="expectation",
                            actor_loss_type="ctl", parameterization="policy_psi_q_p_s_t", target_dist_beta=-1.0)
    batch = SimpleNamespace(train_batch_size=K * PROMPTS, micro_train_batch_size=micro)
    return SimpleNamespace(batch=batch, repulse=repulse)


def _split_steps() -> list[dict]:
    """Each rank, for each split of SPLITS: one proposal step (ZeRO-3) and one policy step (ZeRO-2) of
    `RepulseTrainer` on its share of the samples; the gathered weights and the summed logged losses."""
    import torch.distributed as dist

    from rlhf.distributed.topology import Role, Topology
    from rlhf.repulse.repulse_trainer import PROPOSAL, RepulseTrainer
    from tests.tiny_actor import build_actor

    topology = Topology({Role.ACTOR: (0, 1), PROPOSAL: (0, 1)})
    results = []
    for micro in SPLITS:
        cfg = _repulse_config(micro)
        trainer = RepulseTrainer.__new__(RepulseTrainer)
        trainer.cfg, trainer.rp, trainer.k, trainer.topology = cfg, cfg.repulse, K, topology
        trainer.device = torch.device("cpu")
        share = K * PROMPTS // 2
        trainer.proposal = build_actor(3, LR, share // micro)
        actor = build_actor(2, LR, 2 * share // micro)  # its step takes the positives' and the negatives' micros
        trainer.roles = type("Roles", (), {"actor": actor})()
        negatives, positives = _samples(trainer.proposal.model.module.config.vocab_size)
        q_stats = trainer._train_proposal(negatives, step=0)
        p_stats = trainer._train_policy(positives, negatives, step=0)
        losses = torch.tensor([q_stats["ctl_loss"], p_stats["policy_loss"], p_stats["neg_term"]], dtype=torch.float64)
        dist.all_reduce(losses)
        results.append({"q": dict(trainer.proposal.model.full_parameters()),
                        "p": dict(actor.model.full_parameters()), "losses": losses.tolist()})
    return results


def _plain_step(model, loss: torch.Tensor) -> dict:
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0).step()
    return {n: p.detach() for n, p in model.named_parameters()}


def test_split_groups_take_the_whole_group_step():
    from rlhf.assets import EMBEDDED_MODEL_DIR
    from rlhf.models.lm_logprobs import policy_forward
    from rlhf.models.loading import load_causal_lm
    from rlhf.repulse import repulse_losses
    from tests.tiny_runs import assert_adam_weights_close

    per_rank = run_on_ranks(2, _split_steps)
    q = load_causal_lm(EMBEDDED_MODEL_DIR, torch.float32, "sdpa")
    negatives, positives = _samples(q.config.vocab_size)
    shape = (PROMPTS, K, -1)

    def whole(model, samples):
        return policy_forward(model, samples.sequences_BT, samples.attention_mask_BT).logprobs_BT1

    n = negatives
    ctl, _, _ = repulse_losses.ctl_loss(whole(q, n).reshape(shape), n.logp_BT1.reshape(shape),
                                        n.logq_old_BT1.reshape(shape), n.action_mask_BT1.reshape(shape),
                                        n.beta_r_B.reshape(PROMPTS, K))
    want_q = _plain_step(q, ctl)
    p = load_causal_lm(EMBEDDED_MODEL_DIR, torch.float32, "sdpa")
    mean_pos = repulse_losses.masked_mean_PK(whole(p, positives), positives.action_mask_BT1)
    mean_neg = repulse_losses.masked_mean_PK(whole(p, negatives), negatives.action_mask_BT1)
    policy = repulse_losses.policy_gradient_terms(mean_pos, positives.weights_B).mean()
    neg = repulse_losses.negative_terms(mean_neg, negatives.weights_B).mean()
    want_p = _plain_step(p, policy + ALPHA * neg)
    want_losses = [ctl.item(), policy.item(), neg.item()]
    for i, micro in enumerate(SPLITS):
        got = per_rank[0][i]
        assert max(abs(a - b) for a, b in zip(got["losses"], want_losses)) < 1e-6, (micro, got["losses"], want_losses)
        assert_adam_weights_close(want_q, got["q"], LR, 1, what=f"proposal, micro-batches of {micro}")
        assert_adam_weights_close(want_p, got["p"], LR, 1, what=f"policy, micro-batches of {micro}")
        for role in ("q", "p"):  # both ranks gather the same weights
            assert all(torch.equal(per_rank[1][i][role][n], w) for n, w in got[role].items()), (micro, role)
