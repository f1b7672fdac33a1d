"""RePULSe's math by hand (SNIS weights, CTL loss and its two weight sets, negative training with the
alpha/K normalisation, reward transforms, RLOO baseline, k1 returns, risk statistics) and the analytic
P(bad) of 2-token responses against a 100k-sample Monte-Carlo estimate of the same model."""

import math

import pytest
import torch

from rlhf.repulse import repulse_losses


def _softmax(xs):
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    return [v / sum(e) for v in e]


def test_snis_weights_by_hand():
    # beta = -1, r = (1, 0): logits (-1 - 1 + 1.5, -2 + 0 + 1) = (-0.5, -1)
    w = repulse_losses.snis_weights_PK(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.0, 0.0]]),
                                       torch.tensor([[-1.5, -1.0]]))
    assert w[0].tolist() == pytest.approx([1 / (1 + math.exp(-0.5)), 1 - 1 / (1 + math.exp(-0.5))], abs=1e-6)


def test_ctl_loss_weights_and_gradient_by_hand():
    logq = torch.tensor([[[-0.7, -1.2], [-2.0, -0.3]]], requires_grad=True)  # [P=1, K=2, T1=2]
    logp = torch.tensor([[[-0.9, -1.0], [-1.5, -0.6]]])
    logq_old = torch.tensor([[[-0.8, -1.1], [-1.9, -0.4]]])
    mask = torch.ones(1, 2, 2)
    beta_r = torch.tensor([[0.4, -1.0]])
    loss, w_sigma, w_pi = repulse_losses.ctl_loss(logq, logp, logq_old, mask, beta_r)

    lq, lp, lo, br = logq.detach()[0].tolist(), logp[0].tolist(), logq_old[0].tolist(), beta_r[0].tolist()
    sigma = _softmax([sum(lp[i]) + br[i] - sum(lo[i]) for i in range(2)])
    psi = [[lq[i][t] - lp[i][t] for t in range(2)] for i in range(2)]
    pi = [_softmax([sum(lp[i][u] - lo[i][u] for u in range(t + 1)) + psi[i][t] for i in range(2)]) for t in range(2)]
    expected = -sum(sum((sigma[i] - pi[t][i]) * psi[i][t] for t in range(2)) / 2 for i in range(2)) / 2
    assert w_sigma[0].tolist() == pytest.approx(sigma, abs=1e-6)
    assert w_pi[0].T.tolist() == [pytest.approx(row, abs=1e-6) for row in pi]
    assert float(loss.detach()) == pytest.approx(expected, abs=1e-6)
    loss.backward()  # weights are constants: d loss / d log q_it = -(w_sigma_i - w_pi_it) / (T1 · P·K)
    grad = [[-(sigma[i] - pi[t][i]) / 4 for t in range(2)] for i in range(2)]
    assert logq.grad[0].tolist() == [pytest.approx(row, abs=1e-6) for row in grad]


def test_dpg_loss_and_gradient_by_hand():
    logq = torch.tensor([[[-0.7, -1.2], [-2.0, -0.3]]], requires_grad=True)
    logp = torch.tensor([[[-0.9, -1.0], [-1.5, -0.6]]])
    logq_old = torch.tensor([[[-0.8, -1.1], [-1.9, -0.4]]])
    mask = torch.tensor([[[1.0, 1.0], [1.0, 0.0]]])
    beta_r = torch.tensor([[0.4, -1.0]])
    loss, w = repulse_losses.PROPOSAL_LOSSES["dpg"](logq, logp, logq_old, mask, beta_r)
    lq, lp, lo = logq.detach()[0].tolist(), logp[0].tolist(), logq_old[0].tolist()
    sigma = _softmax([lp[0][0] + lp[0][1] + 0.4 - lo[0][0] - lo[0][1], lp[1][0] - 1.0 - lo[1][0]])
    expected = -(sigma[0] * ((lq[0][0] - lp[0][0]) + (lq[0][1] - lp[0][1])) / 2 + sigma[1] * (lq[1][0] - lp[1][0])) / 2
    assert w[0].tolist() == pytest.approx(sigma, abs=1e-6)
    assert float(loss.detach()) == pytest.approx(expected, abs=1e-6)
    loss.backward()  # -w_sigma_i / (tokens of sample i · P·K) on response tokens, 0 after the response
    assert logq.grad[0].tolist() == [pytest.approx([-sigma[0] / 4, -sigma[0] / 4]), pytest.approx([-sigma[1] / 2, 0.0])]


def test_ctl_and_dpg_terms_on_split_groups_give_the_whole_group_loss_and_gradient():
    """A group cut in two (other micro-batches or ranks): each half's per-sample terms, with w_sigma and w_pi
    computed on the whole group first, add up to the whole-group loss and gradient."""
    g = torch.Generator().manual_seed(0)
    logq = (-torch.rand(2, 4, 3, generator=g)).requires_grad_()  # [P=2, K=4, T1=3]
    logp, logq_old = -torch.rand(2, 4, 3, generator=g), -torch.rand(2, 4, 3, generator=g)
    mask = (torch.rand(2, 4, 3, generator=g) > 0.3).float()
    beta_r = torch.randn(2, 4, generator=g)
    for kind in ("ctl", "dpg"):
        whole = repulse_losses.PROPOSAL_LOSSES[kind](logq, logp, logq_old, mask, beta_r)[0]
        (want,) = torch.autograd.grad(whole, logq)
        w_sigma = repulse_losses.snis_weights_PK(repulse_losses.masked_sum_PK(logp, mask), beta_r,
                                                 repulse_losses.masked_sum_PK(logq_old, mask)).reshape(8)
        w_pi = repulse_losses.ctl_pi_weights_PKT1(logq, logp, logq_old, mask).reshape(8, 3)
        flat = [t.reshape(8, -1) for t in (logq, logp, mask)]
        halves = [repulse_losses.PROPOSAL_TERMS[kind](*(t[rows] for t in flat), w_sigma[rows], w_pi[rows]).sum()
                  for rows in (slice(0, 3), slice(3, 8))]  # the first group split 3 + 1
        split = -sum(halves) / 8
        (got,) = torch.autograd.grad(split, logq)
        assert split.item() == pytest.approx(whole.item(), abs=1e-7), kind
        torch.testing.assert_close(got, want, rtol=0, atol=1e-7)


def test_ctl_loss_ignores_positions_after_the_response():
    logq = torch.tensor([[[-0.7, -1.2], [-2.0, -0.3]]])
    logp = torch.tensor([[[-0.9, -1.0], [-1.5, -0.6]]])
    mask = torch.tensor([[[1.0, 0.0], [1.0, 1.0]]])
    changed = logq.clone()
    changed[0, 0, 1] = -50.0  # a padded position of sample 0
    a = repulse_losses.ctl_loss(logq, logp, logq, mask, torch.zeros(1, 2))
    b = repulse_losses.ctl_loss(changed, logp, changed, mask, torch.zeros(1, 2))
    assert float(a[0]) == pytest.approx(float(b[0]), abs=1e-7)
    assert torch.equal(a[1], b[1])


def test_rloo_baseline_and_reinforce_by_hand():
    assert repulse_losses.rloo_baseline_PK(torch.tensor([[1.0, 2.0, 6.0]])).tolist() == [[4.0, 3.5, 1.5]]
    # returns (1, 3): baselines (3, 1), advantages (-2, 2); mean log-probs (-1, -2): -mean(2, -4) = 1
    loss = repulse_losses.reinforce_loss(torch.tensor([[-1.0, -2.0]]), torch.tensor([[1.0, 3.0]]))
    assert float(loss) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="--duplicate_rollout_batch_by"):
        repulse_losses.rloo_baseline_PK(torch.tensor([[1.0]]))


def test_neg_training_loss_alpha_over_k():
    mean_logp, returns = torch.tensor([[-1.0, -2.0]]), torch.tensor([[1.0, 3.0]])
    w, neg_logp = torch.tensor([[0.25, 0.75]]), torch.tensor([[-3.0, -1.0]])
    # the policy's update under --harmlessness_training_loss_type neg_training, as the trainer sums it
    negative = repulse_losses.negative_terms(neg_logp, w).sum() / w.numel()
    loss = repulse_losses.reinforce_loss(mean_logp, returns) + 0.5 * negative
    # the negative term is a mean over P·K = 2 of w·l: (0.25·-3 + 0.75·-1) / 2 = -0.75, i.e. (alpha / K)·sum w·l
    assert float(negative) == pytest.approx(-0.75)
    assert float(loss) == pytest.approx(1.0 + 0.5 * -0.75)
    assert float(loss) == pytest.approx(1.0 + (0.5 / 2) * (0.25 * -3 + 0.75 * -1))


def test_reward_transforms_and_base_as_proposal_weights():
    r = torch.tensor([-1.0, 0.0, 2.0])
    got = repulse_losses.REWARD_TRANSFORMS["minus_alpha_exp_beta_r"](r, 0.5, -1.0, 0.0)
    assert got.tolist() == pytest.approx([-1 - 0.5 * math.e, -0.5, 2 - 0.5 * math.exp(-2)], abs=1e-6)
    got = repulse_losses.REWARD_TRANSFORMS["minus_alpha_ind"](r, 0.5, -1.0, 0.5)
    assert got.tolist() == pytest.approx([-1.5, -0.5, 2.0])
    w = repulse_losses.base_as_proposal_weights_PK(torch.tensor([[0.0, math.log(3.0)]]))
    assert w[0].tolist() == pytest.approx([0.25, 0.75], abs=1e-6)


def test_policy_returns_k1_kl():
    logp_old = torch.tensor([[[-1.0, -2.0], [-0.5, -0.5]]])
    ref = torch.tensor([[[-1.5, -1.0], [-0.5, -9.0]]])
    mask = torch.tensor([[[1.0, 1.0], [1.0, 0.0]]])
    returns, kl = repulse_losses.policy_returns_PK(torch.tensor([[1.0, 2.0]]), logp_old, ref, mask, kl_coef=0.1)
    assert kl[0].tolist() == pytest.approx([0.5 - 1.0, 0.0])
    assert returns[0].tolist() == pytest.approx([1.0 + 0.05, 2.0])


def test_risk_statistics():
    r = torch.tensor([3.0, -2.0, 0.5, -4.0, 1.0])
    assert repulse_losses.prob_below(r, 0.0) == pytest.approx(0.4)
    assert repulse_losses.cvar(r, 0.4) == pytest.approx(-3.0)  # the worst 2 of 5
    assert repulse_losses.cvar(r, 0.1) == pytest.approx(-4.0)  # at least one sample
    with pytest.raises(ValueError, match="CVaR"):
        repulse_losses.cvar(r, 0.0)


# ---- analytic P(bad) ------------------------------------------------------------------------------


def test_log_p_bad_by_hand():
    from rlhf.repulse.bad_outputs import log_p_bad

    first = torch.tensor([0.5, 0.3, 0.2]).log()
    second = torch.tensor([[0.1, 0.1, 0.8], [0.6, 0.2, 0.2], [0.3, 0.3, 0.4]]).log()
    # B = {2}: 0.2 + 0.5·0.8 + 0.3·0.2 = 0.66; with EOS = 1 the 0.3 branch ends: 0.2 + 0.4 = 0.6
    assert math.exp(float(log_p_bad(first, second, [2]))) == pytest.approx(0.66, abs=1e-6)
    assert math.exp(float(log_p_bad(first, second, [2], eos_token_id=1))) == pytest.approx(0.6, abs=1e-6)


def test_analytic_p_bad_matches_monte_carlo():
    """100k ancestral samples of 2-token responses from the embedded tiny policy: the Monte-Carlo fraction
    with a bad token lies within 4 standard errors (sqrt(p(1-p)/n) ~ 1e-3) of the exact value."""
    from rlhf.assets import EMBEDDED_MODEL_DIR
    from rlhf.models.loading import load_causal_lm
    from rlhf.repulse.bad_outputs import log_p_bad, next_token_logprobs_V, second_token_logprobs_VV

    model = load_causal_lm(EMBEDDED_MODEL_DIR, torch.float32, "sdpa").eval()
    prompt, bad, eos, temperature = [2, 35, 4, 14, 5], [41, 42, 43], 3, 1.5
    first_V = next_token_logprobs_V(model, torch.tensor([prompt]), temperature)[0]
    second_VV = second_token_logprobs_VV(model, prompt, first_V.shape[0], temperature)
    exact = math.exp(float(log_p_bad(first_V, second_VV, bad, eos_token_id=eos)))

    n = 100_000
    g = torch.Generator().manual_seed(0)
    a = torch.multinomial(first_V.exp(), n, replacement=True, generator=g)
    b = torch.multinomial(second_VV.exp()[a], 1, generator=g)[:, 0]
    bad_t = torch.tensor(bad)
    is_bad = torch.isin(a, bad_t) | ((a != eos) & torch.isin(b, bad_t))
    estimate = float(is_bad.float().mean())
    stderr = math.sqrt(exact * (1 - exact) / n)
    assert 0.01 < exact < 0.5
    assert abs(estimate - exact) < 4 * stderr, (estimate, exact, stderr)


def test_rm_max_len_truncates_what_reward_models_see():
    """ExperienceMaker.score hands the reward path samples cut to --rm_max_len tokens (texts unchanged)."""
    from types import SimpleNamespace

    from rlhf.data.records import Rollout
    from rlhf.trainers.experience import ExperienceMaker, Scored

    seen = []
    stub = SimpleNamespace(
        _by_role=lambda role, compute, shape, balance=None: compute(slice(None)),
        actor=SimpleNamespace(logprobs=lambda seq, mask: torch.zeros(seq.shape[0], seq.shape[1] - 1),
                              infer_batcher=None),
        _rewards=lambda batch: Scored(seen.append(batch) or torch.zeros(batch.num_samples), None, {}))
    stub._logprobs = lambda batch, with_ref: ExperienceMaker._logprobs(stub, batch, with_ref)
    B, T = 2, 6
    batch = Rollout(torch.arange(B * T).reshape(B, T), torch.ones(B, T, dtype=torch.long), torch.ones(B, T - 1),
                    torch.zeros(B, T - 1), torch.tensor([2, 2]), torch.tensor([4, 4]), ["stop"] * B, ["p"] * B,
                    ["r"] * B)
    ExperienceMaker.score(stub, batch, with_ref=False, rm_max_len=4)
    ExperienceMaker.score(stub, batch, with_ref=False, rm_max_len=10)
    assert seen[0].sequences_BT.tolist() == [[0, 1, 2, 3], [6, 7, 8, 9]]
    assert seen[0].attention_mask_BT.shape == (2, 4) and seen[0].responses == ["r", "r"]
    assert seen[1] is batch  # shorter than the limit: untouched


def test_exp_reward_transform_never_overflows_silently():
    """alpha 0.5, beta -10: r = -1 gives -1 - 0.5·e^10 = -11014.2329 (float64 inside); r = -10 gives -1.3e43,
    which float32 cannot hold (it was -inf, and the leave-one-out baseline then made the whole group NaN): an
    error naming the flags. Large but representable returns keep a finite baseline (the sum is float64)."""
    shaped = repulse_losses.minus_alpha_exp_beta_r(torch.tensor([-1.0, 0.0]), 0.5, -10.0, -5.0)
    assert shaped.dtype == torch.float32
    assert shaped.tolist() == pytest.approx([-1 - 0.5 * math.exp(10), -0.5], rel=1e-7)
    with pytest.raises(ValueError, match=r"is -1.34e\+43 for the reward -10, beyond what float32 training holds.*"
                                         r"--rew_trans_alpha or the magnitude of --rew_trans_beta"):
        repulse_losses.minus_alpha_exp_beta_r(torch.tensor([0.5, -10.0]), 0.5, -10.0, -5.0)
    big = torch.full((1, 4), -3e38)
    assert repulse_losses.rloo_baseline_PK(big).flatten().tolist() == pytest.approx([-3e38] * 4, rel=1e-6)
