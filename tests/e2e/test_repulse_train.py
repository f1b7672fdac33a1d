"""RePULSe (`train_repulse`) on the embedded toy (one prompt, 2-word responses, bad words x y z): a run resumed from
a checkpoint equals the uninterrupted one (policy and proposal weights, both optimisers, the sample counter, the
analytic evaluation); CTL moves q toward sigma; packed == padded; held-out sampling evaluation saves every sample;
the proposal on its own rank == colocated."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from rlhf.assets import TINY_DIR, TOY_BAD_WORDS, TOY_PROMPT, TOY_REWARD
from rlhf.utils.checkpoint_files import complete_checkpoints
from tests.distributed import run_job_variants
from tests.tiny_runs import TRAIN, assert_adam_weights_close

TOY = [*TRAIN, "--pretrain", f"{TINY_DIR}/policy", "--remote_rm_url", TOY_REWARD, "--new_custom_single_prompt",
       "--custom_prompt", TOY_PROMPT, "--input_template", "{} ", "--do_harmlessness_training",
       "--generate_max_len", "2", "--prompt_max_len", "8", "--init_kl_coef", "0", "--rollout_engine", "hf",
       "--lr_scheduler", "constant", "--lr_warmup_ratio", "0", "--adam_betas", "0.9", "0.999",
       "--analytic_bad_word_calc", "--bad_words", TOY_BAD_WORDS, "--target_dist_beta", "-1",
       "--harmlessness_training_loss_type", "neg_training", "--reinforce_baseline_type", "expectation",
       "--actor_loss_type", "ctl", "--parameterization", "policy_psi_q_p_s_t"]


def _results(out):
    with open(out / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    return rows, load_file(out / "model" / "model.safetensors"), load_file(out / "proposal" / "model.safetensors")


def _train(out, nproc, *extra):
    run_job_variants(nproc, [("train_repulse", [*TOY, "--save_path", str(out), *extra])],
                     out.parent / f"consoles-{out.name}", out)
    return _results(out)


def _train_variants(nproc, runs, base=TOY):
    """`_train` for each (out, extra flags) of `runs`, one after another in the same rank
    processes (`run_job_variants`); each result also carries its console output."""
    outputs = run_job_variants(nproc, [("train_repulse", [*base, "--save_path", str(out), *extra])
                                       for out, extra in runs],
                               runs[0][0].parent / f"consoles-{runs[0][0].name}", timeout=1500)
    return [(*_results(out), text) for (out, _), text in zip(runs, outputs)]


def test_repulse_resume_equals_uninterrupted(tmp_path):
    run = ["--duplicate_rollout_batch_by", "4", "--rollout_batch_size", "2", "--train_batch_size", "8",
           "--micro_train_batch_size", "4", "--fit_steps", "2", "--harmlessness_training_num_episodes", "2",
           "--alpha", "1", "--actor_learning_rate", "3e-3", "--base_actor_learning_rate", "3e-3", "--seed", "3",
           "--zero_stage", "2"]
    run += ["--save_negdata", "--save_negdata_threshold", "0"]  # the responses with a negative reward
    ckpt = tmp_path / "ckpt"
    straight, saving = _train_variants(2, [
        (tmp_path / "straight", [*run, "--save_info_path", str(tmp_path / "straight" / "info")]),
        (tmp_path / "saving", [*run, "--save_steps_harmless", "2", "--ckpt_path", str(ckpt),
                               "--save_info_path", str(tmp_path / "saving" / "info")])])
    assert [s for s, _ in complete_checkpoints(str(ckpt))] == [2, 4]
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    (resumed_dir / "metrics.jsonl").write_text("".join(
        json.dumps(r) + "\n" for r in saving[0] if r["step"] <= 2))
    import shutil

    shutil.rmtree(ckpt / "global_step4")
    shutil.copytree(ckpt, tmp_path / "ckpt_moved")
    # the lost attempt's files run to step 4: the resumed run cuts them back to the checkpoint's rows
    shutil.copy(tmp_path / "saving" / "negdata.jsonl", resumed_dir / "negdata.jsonl")
    shutil.copytree(tmp_path / "saving" / "info", resumed_dir / "info")
    resumed = _train(resumed_dir, 2, *run, "--load_checkpoint", "--ckpt_path", str(ckpt),
                     "--save_info_path", str(resumed_dir / "info"))
    negdata = [json.loads(line) for line in (tmp_path / "straight" / "negdata.jsonl").open()]
    assert negdata and all(r["reward"] < 0 for r in negdata) and {r["source"] for r in negdata} == {"policy",
                                                                                                 "proposal"}
    for name in ("negdata.jsonl", "info/evaluations.jsonl"):
        assert (resumed_dir / name).read_text() == (tmp_path / "straight" / name).read_text(), name
    assert len((tmp_path / "straight" / "info" / "evaluations.jsonl").read_text().splitlines()) == 3
    steps = [r["step"] for r in straight[0]]
    assert steps == [0, 1, 2, 3, 4] and [r["step"] for r in resumed[0]] == steps
    for a, b in zip(straight[0], resumed[0]):
        assert set(a) == set(b)
        for key, value in a.items():
            if key.startswith(("time/", "perf/")) or key.endswith("_s") or value is None:
                continue
            assert b[key] == pytest.approx(value, rel=1e-6, abs=1e-9), (a["step"], key)
    assert straight[0][-1]["samples_drawn"] == 4 * 2 * 8  # steps x (p + q) x 8 samples
    assert "log_p_bad" in straight[0][2] and "log_p_bad" in straight[0][4]
    for got, want in ((resumed[1], straight[1]), (resumed[2], straight[2])):
        for name, weight in want.items():
            torch.testing.assert_close(got[name], weight, rtol=0, atol=0, msg=name)
    assert any(not torch.equal(straight[1][n], straight[2][n]) for n in straight[1])  # p and q differ
    # the same checkpoint resumed on 1 rank at ZeRO-3: the policy and the proposal move, and the run continues the
    # straight one's steps (another summation order: AdamW's bound, metrics rel 1e-4)
    moved_dir = tmp_path / "moved"
    moved_dir.mkdir()
    (moved_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in saving[0] if r["step"] <= 2))
    moved_run = run[:-3]  # without --save_negdata (its file belongs to the other resume)
    moved_run[moved_run.index("--zero_stage") + 1] = "3"
    moved, = _train_variants(1, [(moved_dir, [*moved_run, "--load_checkpoint", "--ckpt_path",
                                              str(tmp_path / "ckpt_moved")])])
    assert "the actor's state moved from ZeRO-2 over 2 ranks to ZeRO-3 over 1 rank" in moved[3]
    assert "the proposal's state moved from ZeRO-2 over 2 ranks to ZeRO-3 over 1 rank" in moved[3]
    assert [r["step"] for r in moved[0]] == steps
    for a, b in zip(straight[0][3:], moved[0][3:]):
        for key in ("loss", "policy_loss", "reward_mean", "log_p_bad", "lr"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)
    assert_adam_weights_close(straight[1], moved[1], lr=3e-3, steps=2, what="policy")
    assert_adam_weights_close(straight[2], moved[2], lr=3e-3, steps=2, what="proposal")


def _enumerate(model, prompt_ids, tokenizer):
    """log p(a, b) of every 2-token response [V, V] (EOS first: the response [eos] at b = 0) and the decoded
    responses."""
    from rlhf.repulse.bad_outputs import next_token_logprobs_V, second_token_logprobs_VV

    first = next_token_logprobs_V(model, torch.tensor([prompt_ids]))[0]
    second = second_token_logprobs_VV(model, prompt_ids, first.shape[0])
    joint = first[:, None] + second
    eos, V = tokenizer.eos_token_id, first.shape[0]
    joint[eos] = float("-inf")
    joint[eos, 0] = first[eos]
    pairs = [[a, b] if a != eos else [a] for a in range(V) for b in range(V)]
    return joint, tokenizer.batch_decode(pairs, skip_special_tokens=True)


CTL_RUN = ["--duplicate_rollout_batch_by", "16", "--rollout_batch_size", "1", "--train_batch_size", "16",
           "--micro_train_batch_size", "16", "--fit_steps", "1", "--harmlessness_training_num_episodes", "60",
           "--alpha", "0", "--actor_learning_rate", "1e-2", "--base_actor_learning_rate", "0", "--seed", "1",
           "--zero_stage", "0"]
PACKING_RUN = ["--duplicate_rollout_batch_by", "4", "--rollout_batch_size", "2", "--train_batch_size", "8",
               "--micro_train_batch_size", "4", "--fit_steps", "1", "--harmlessness_training_num_episodes", "2",
               "--alpha", "1", "--actor_learning_rate", "1e-3", "--base_actor_learning_rate", "1e-3", "--seed", "1",
               "--zero_stage", "2"]


def _heldout_run(heldout) -> list[str]:
    return ["--duplicate_rollout_batch_by", "4", "--rollout_batch_size", "1", "--train_batch_size", "4",
            "--micro_train_batch_size", "4", "--fit_steps", "2", "--harmlessness_training_num_episodes", "1",
            "--alpha", "1", "--seed", "1", "--actor_learning_rate", "1e-3", "--base_actor_learning_rate", "1e-3",
            "--init_kl_coef", "0.1", "--evaluate_heldout_sampling", "--heldout_prompt_data", str(heldout),
            "--heldout_input_key", "text", "--sampling_iters", "2", "--threshold", "0", "--heldout_cvar_fraction",
            "0.25"]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """The 1-rank runs of this file in one launch (`_train_variants`): name -> (its directory, its metrics, its
    policy and proposal weights). The held-out prompts are in the directory's parent, heldout.jsonl."""
    tmp = tmp_path_factory.mktemp("one_rank")
    heldout = tmp / "heldout.jsonl"
    heldout.write_text('{"text": "copy :"}\n{"text": "a :"}\n{"text": "b :"}\n')
    runs = {"ctl": CTL_RUN, "heldout": _heldout_run(heldout), "padded": PACKING_RUN,
            "packed": [*PACKING_RUN, "--packing_samples"]}
    results = _train_variants(1, [(tmp / name, extra) for name, extra in runs.items()])
    return {name: (tmp / name, *result[:3]) for name, result in zip(runs, results)}


def test_ctl_moves_the_proposal_toward_sigma(one_rank):
    """p fixed (--base_actor_learning_rate 0): sigma ∝ p·exp(-r) is fixed, and q learns it by CTL."""
    from rlhf.assets.toy.reward import BAD_WORDS  # noqa: F401 - the toy's bad set, by name
    from rlhf.models.loading import load_causal_lm, load_tokenizer
    from rlhf.rewards.reward_func import load_reward_func

    run, _, policy, _ = one_rank["ctl"]
    tok = load_tokenizer(f"{TINY_DIR}/policy")
    prompt = TOY_PROMPT + " "
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    p = load_causal_lm(f"{TINY_DIR}/policy", torch.float32, "sdpa").eval()
    q = load_causal_lm(str(run / "proposal"), torch.float32, "sdpa").eval()
    for name, weight in p.state_dict().items():  # lr 0: the policy did not move
        if name in policy:
            torch.testing.assert_close(policy[name], weight, rtol=0, atol=0)
    log_p, responses = _enumerate(p, ids, tok)
    log_q, _ = _enumerate(q, ids, tok)
    rewards = load_reward_func(TOY_REWARD)([prompt + r for r in responses], [prompt] * len(responses), None)
    rewards = rewards.reshape(log_p.shape)
    bad = rewards < -1
    sigma = torch.softmax((log_p - rewards).flatten(), 0).reshape(log_p.shape)  # beta = -1
    exact = float((sigma * rewards).sum())
    p_bad, q_bad, sigma_bad = (float(torch.where(bad, x, 0).sum()) for x in (log_p.exp(), log_q.exp(), sigma))
    assert sigma_bad > 0.8 and p_bad < 0.15
    assert q_bad > 4 * p_bad and q_bad > 0.5, (p_bad, q_bad, sigma_bad)

    def snis(log_proposal, n=2048, seed=0):  # K = n samples of the proposal, self-normalised toward sigma
        g = torch.Generator().manual_seed(seed)
        idx = torch.multinomial(log_proposal.exp().flatten(), n, replacement=True, generator=g)
        logw = (log_p - rewards - log_proposal).flatten()[idx]
        return float((torch.softmax(logw, 0) * rewards.flatten()[idx]).sum())

    q_estimates = [snis(log_q, seed=s) for s in range(5)]
    p_estimates = [snis(log_p, n=64, seed=s) for s in range(5)]  # p as its own proposal, the training group size
    assert abs(sum(q_estimates) / 5 - exact) < 0.25, (q_estimates, exact)
    assert max(abs(e - exact) for e in q_estimates) < max(abs(e - exact) for e in p_estimates)
    assert math.isfinite(exact)


def test_packed_repulse_steps_equal_padded(one_rank):
    """--packing_samples gives the padded run's losses and gradient norms of both models (2 steps)."""
    padded, packed = one_rank["padded"][1], one_rank["packed"][1]
    assert len(padded) == len(packed) == 3  # the evaluation before, then 2 steps (the last with its evaluation)
    for a, b in zip(padded, packed):
        for key in ("policy_loss", "neg_term", "ctl_loss", "grad_norm", "q_grad_norm", "reward_mean", "log_p_bad"):
            if key in a:
                # float32 rounding of packed vs padded forwards: losses of ~0.03 agree to ~4e-7
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (a["step"], key)


def test_heldout_sampling_evaluation_saves_every_sample(one_rank):
    """--evaluate_heldout_sampling: after every fit step (and before training) K x --sampling_iters samples per
    held-out prompt are saved with reward, return and KL; the reported statistics are those of the file."""
    run, rows, _, _ = one_rank["heldout"]
    evals = [r for r in rows if "heldout_cvar" in r]
    assert [r["step"] for r in evals] == [0, 1, 2] and all("log_p_bad" in r for r in evals)
    for r in evals:
        saved = [json.loads(line) for line in (run / f"heldout_{int(r['samples_drawn'])}.jsonl").open()]
        assert len(saved) == 3 * 4 * 2
        rewards = torch.tensor([s["reward"] for s in saved])
        assert r["heldout_reward_mean"] == pytest.approx(float(rewards.mean()), abs=1e-6)
        assert r["heldout_return_mean"] == pytest.approx(sum(s["return"] for s in saved) / len(saved), abs=1e-6)
        assert r["heldout_p_below"] == pytest.approx(float((rewards < 0).float().mean()))
        assert r["heldout_cvar"] == pytest.approx(float(rewards.sort().values[:6].mean()), abs=1e-6)
        for s in saved:
            assert s["return"] == pytest.approx(s["reward"] - 0.1 * s["kl"], abs=1e-5)
    assert evals[-1]["heldout_kl_mean"] != 0  # the policy moved away from the reference


def test_proposal_on_its_own_rank_equals_colocated(tmp_path):
    """q on a rank of its own (--proposal_num_gpus_per_node 1, p on the other rank) trains both models as the
    colocated layout does (both on 2 ranks): same metrics, same final weights (to float reduction order, by AdamW's
    bound: 2.3e-7 apart at most, measured)."""
    analytic = TOY.index("--analytic_bad_word_calc")
    base = [a for i, a in enumerate(TOY) if i not in (analytic, analytic + 1, analytic + 2)]
    run = ["--duplicate_rollout_batch_by", "4", "--rollout_batch_size", "2", "--train_batch_size", "8",
           "--micro_train_batch_size", "4", "--fit_steps", "1", "--harmlessness_training_num_episodes", "3",
           "--alpha", "1", "--actor_learning_rate", "3e-3", "--base_actor_learning_rate", "3e-3", "--seed", "5",
           "--zero_stage", "2", "--save_negdata", "--save_negdata_threshold", "0"]

    colocated, disjoint = _train_variants(2, [
        (tmp_path / "colocated", run),
        (tmp_path / "disjoint", [*run, "--actor_num_gpus_per_node", "1", "--proposal_num_gpus_per_node", "1"])],
        base=base)
    assert "data-parallel replicas: actor 1, reward 2, proposal 1" in disjoint[3]
    assert "data-parallel replicas: actor 2, reward 2, proposal 2" in colocated[3]
    assert len(colocated[0]) == len(disjoint[0]) == 3
    for a, b in zip(colocated[0], disjoint[0]):
        for key in ("policy_loss", "neg_term", "ctl_loss", "grad_norm", "q_grad_norm", "reward_mean",
                    "q_reward_mean", "q_weights_ess", "samples_drawn"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)
    for got, want, what in ((disjoint[1], colocated[1], "policy"), (disjoint[2], colocated[2], "proposal")):
        assert_adam_weights_close(want, got, lr=3e-3, steps=3, what=what)  # 3 episodes of one step each
    negdata = [(tmp_path / name / "negdata.jsonl").read_text() for name in ("colocated", "disjoint")]
    assert negdata[0] and negdata[0] == negdata[1]
