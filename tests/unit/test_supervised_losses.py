"""SFT, pairwise reward-model and PRM losses against hand-computed values, and their global-count
splits against the whole-batch mean."""

import math

import pytest
import torch

from rlhf.algorithms.reward_model import (
    PAIRWISE_LOSSES,
    logexp_pairwise_loss_B,
    prm_loss,
    prm_token_losses_N,
    sigmoid_pairwise_loss_B,
)
from rlhf.algorithms.sft_loss import assistant_loss_mask_T1, nll_over_global_count

LN2, LN3 = math.log(2.0), math.log(3.0)


# --- SFT ---------------------------------------------------------------------------------------------

def test_nll_over_global_count_hand_values():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -4.0, -1.0]])
    mask = torch.tensor([[0, 1, 1], [1, 0, 0]])
    # targets: -2, -3, -0.5 -> NLL sum 5.5
    torch.testing.assert_close(nll_over_global_count(logprobs, mask, 3), torch.tensor(5.5 / 3))
    torch.testing.assert_close(nll_over_global_count(logprobs, mask, 11), torch.tensor(0.5))


def test_nll_micro_batches_with_global_count_sum_to_batch_token_mean():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -4.0, -1.0], [-2.5, -1.5, -0.25]])
    mask = torch.tensor([[0, 1, 1], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    # all 6 targets: 2 + 3 + 0.5 + 2.5 + 1.5 + 0.25 = 9.75 -> token mean 1.625
    pieces = [nll_over_global_count(logprobs[i:i + 1], mask[i:i + 1], 6) for i in range(3)]
    torch.testing.assert_close(sum(pieces), torch.tensor(1.625))


def test_nll_ignores_neg_inf_outside_mask_and_has_token_gradient():
    logprobs = torch.tensor([[-1.0, -math.inf], [-2.0, -0.5]], requires_grad=True)
    mask = torch.tensor([[1, 0], [1, 1]])
    loss = nll_over_global_count(logprobs, mask, 4)
    torch.testing.assert_close(loss, torch.tensor(3.5 / 4))
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.25, 0.0], [-0.25, -0.25]]))


def test_assistant_loss_mask_marks_every_assistant_token_as_target():
    # 10 tokens, assistant turns at tokens 2..4 and 7..9 -> positions 1..3 and 6..8 predict them
    mask = assistant_loss_mask_T1([(2, 5), (7, 10)], seq_len=10)
    expected = torch.tensor([0, 1, 1, 1, 0, 0, 1, 1, 1], dtype=torch.bool)
    torch.testing.assert_close(mask, expected)


def test_assistant_loss_mask_single_turn_equals_openrlhf_prompt_mask():
    # OpenRLHF: loss_mask[prompt_len - 1 : -1] = 1 over 7 tokens with prompt_len 4 -> [0,0,0,1,1,1,0], then [:-1]
    torch.testing.assert_close(assistant_loss_mask_T1([(4, 7)], seq_len=7),
                               torch.tensor([0, 0, 0, 1, 1, 1], dtype=torch.bool))


def test_assistant_loss_mask_clips_truncated_spans_and_rejects_token_zero():
    torch.testing.assert_close(assistant_loss_mask_T1([(3, 9), (12, 15)], seq_len=5),
                               torch.tensor([0, 0, 1, 1], dtype=torch.bool))
    with pytest.raises(ValueError, match="token 0"):
        assistant_loss_mask_T1([(0, 3)], seq_len=5)


# --- pairwise reward-model losses --------------------------------------------------------------------

def test_sigmoid_pairwise_hand_values_with_and_without_margin():
    chosen, rejected = torch.tensor([2.0, 0.0, 1.0]), torch.tensor([0.0, 0.0, 3.0])
    # -log sigmoid(x) = log(1 + exp(-x)) at x = 2, 0, -2
    torch.testing.assert_close(sigmoid_pairwise_loss_B(chosen, rejected),
                               torch.tensor([math.log(1 + math.exp(-2)), LN2, math.log(1 + math.exp(2))]))
    # margins 1, -1, 0 -> x = 1, 1, -2
    out = sigmoid_pairwise_loss_B(chosen, rejected, torch.tensor([1.0, -1.0, 0.0]))
    torch.testing.assert_close(out, torch.tensor([math.log(1 + math.exp(-1))] * 2 + [math.log(1 + math.exp(2))]))


def test_logexp_ignores_margin_like_openrlhf_and_warns():
    chosen, rejected = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 1.0])
    expected = torch.tensor([math.log(1 + math.exp(-2)), math.log(1 + math.exp(1))])
    torch.testing.assert_close(logexp_pairwise_loss_B(chosen, rejected), expected)
    with pytest.warns(UserWarning, match="ignores the margin"):
        torch.testing.assert_close(logexp_pairwise_loss_B(chosen, rejected, torch.tensor([5.0, 5.0])), expected)


def test_logexp_stays_finite_where_literal_log1p_exp_overflows():
    out = logexp_pairwise_loss_B(torch.tensor([0.0]), torch.tensor([100.0]))
    torch.testing.assert_close(out, torch.tensor([100.0]))


def test_pairwise_table_and_global_pair_count():
    assert set(PAIRWISE_LOSSES) == {"sigmoid", "logexp"}
    chosen, rejected = torch.tensor([1.0, 0.0, 3.0, 0.5]), torch.tensor([0.0, 1.0, 1.0, 0.5])
    whole = PAIRWISE_LOSSES["sigmoid"](chosen, rejected).mean()
    halves = sum(PAIRWISE_LOSSES["sigmoid"](chosen[i:i + 2], rejected[i:i + 2]).sum() / 4 for i in (0, 2))
    torch.testing.assert_close(halves, whole)


# --- process reward model ----------------------------------------------------------------------------

def _prm_logits(rows_5_7):
    """[N, 8] logits with the given values at reward tokens 5 and 7 and a large decoy at token 0."""
    logits = torch.full((len(rows_5_7), 8), -1.0)
    logits[:, 0] = 10.0
    logits[:, [5, 7]] = torch.tensor(rows_5_7)
    return logits.requires_grad_()


def test_prm_hard_labels_index_the_reward_tokens_and_see_only_their_logits():
    logits = _prm_logits([[LN3, 0.0], [0.0, 0.0], [0.0, 5.0]])
    labels = torch.tensor([0, 1, -100])  # tokens 5, 7, ignored
    loss, acc = prm_loss(logits, labels, reward_token_ids=[5, 7])
    # row 0: softmax over (ln 3, 0) = (3/4, 1/4), label 5 -> ln(4/3), right; row 1: ln 2, a tie -> token 5, wrong
    torch.testing.assert_close(loss, torch.tensor((math.log(4 / 3) + LN2) / 2))
    torch.testing.assert_close(acc, torch.tensor(0.5))
    loss.backward()
    # d/dlogit = (softmax - onehot) / 2 on the reward tokens, nothing elsewhere or at the ignored row
    expected = torch.zeros(3, 8)
    expected[0, [5, 7]] = torch.tensor([-1 / 8, 1 / 8])
    expected[1, [5, 7]] = torch.tensor([1 / 4, -1 / 4])
    torch.testing.assert_close(logits.grad, expected)


def test_prm_hard_labels_without_reward_tokens_use_the_whole_vocabulary():
    logits = torch.tensor([[0.0, LN2, 0.0], [LN3, 0.0, 0.0]])
    loss, acc = prm_loss(logits, torch.tensor([1, 2]), reward_token_ids=None)
    # row 0: p(1) = 2/4; row 1: p(2) = 1/5
    torch.testing.assert_close(loss, torch.tensor((LN2 + math.log(5)) / 2))
    torch.testing.assert_close(acc, torch.tensor(0.5))


def test_prm_soft_labels_are_the_probability_of_the_first_reward_token():
    logits = _prm_logits([[LN3, 0.0], [0.0, math.log(4)]])
    labels = torch.tensor([0.8, 0.5])
    loss_N, counted_N, correct_N = prm_token_losses_N(logits, labels, [5, 7])
    # row 0: q = (3/4, 1/4); row 1: q = (1/5, 4/5); target (p, 1 - p)
    expected = torch.tensor([-(0.8 * math.log(3 / 4) + 0.2 * math.log(1 / 4)),
                             -(0.5 * math.log(1 / 5) + 0.5 * math.log(4 / 5))])
    torch.testing.assert_close(loss_N, expected)
    assert counted_N.tolist() == [True, True]
    # row 0: target positive (0.8 >= 0.5), argmax positive; row 1: tie 0.5 -> positive, argmax negative
    assert correct_N.tolist() == [True, False]
    loss, acc = prm_loss(logits, labels, [5, 7])
    loss.backward()
    expected_grad = torch.zeros(2, 8)
    expected_grad[0, [5, 7]] = torch.tensor([(0.75 - 0.8) / 2, (0.25 - 0.2) / 2])
    expected_grad[1, [5, 7]] = torch.tensor([(0.2 - 0.5) / 2, (0.8 - 0.5) / 2])
    torch.testing.assert_close(logits.grad, expected_grad)
    torch.testing.assert_close(acc, torch.tensor(0.5))


def test_prm_soft_label_ignore_index_is_skipped():
    logits = _prm_logits([[LN3, 0.0], [0.0, 0.0]])
    loss, acc = prm_loss(logits, torch.tensor([1.0, -100.0]), [5, 7])
    torch.testing.assert_close(loss, torch.tensor(math.log(4 / 3)))
    torch.testing.assert_close(acc, torch.tensor(1.0))


def test_prm_micro_batches_with_global_count_sum_to_batch_mean():
    g = torch.Generator().manual_seed(0)
    logits = 2 * torch.randn(6, 8, generator=g)
    labels = torch.tensor([0, 1, -100, 1, 0, 0])
    whole, _ = prm_loss(logits, labels, [5, 7])
    pieces = sum(prm_loss(logits[i:i + 3], labels[i:i + 3], [5, 7], num_positions=5)[0] for i in (0, 3))
    torch.testing.assert_close(pieces, whole)


def test_prm_label_errors_name_the_fix():
    logits = _prm_logits([[0.0, 0.0]])
    with pytest.raises(ValueError, match="indices into the 2 classes"):
        prm_loss(logits, torch.tensor([5]), [5, 7])
    with pytest.raises(ValueError, match="exactly two --reward_tokens"):
        prm_loss(logits, torch.tensor([0.5]), [5, 7, 0])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        prm_loss(logits, torch.tensor([1.5]), [5, 7])
