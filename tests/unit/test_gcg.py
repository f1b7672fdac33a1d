"""evaluate_gcg: the GCG pieces against hand computations on the embedded tiny policy (target loss from the model's
log-softmax, one-hot gradients against autograd through the embeddings and central differences in float64,
candidates that change exactly n_replace positions to top-k tokens, the round-trip filter, steps that never raise
the best loss), the config's refusals and notes, and short CLI runs on the embedded defaults and with reward_func
files whose rewards fix the attack success rate."""

from __future__ import annotations

import copy
import functools
import json

import pytest
import torch

from rlhf.assets import EMBEDDED_MODEL_DIR
from rlhf.cli.evaluate_gcg import main
from rlhf.config.errors import UsageError
from rlhf.config.flags import flag_specs, parse_config
from rlhf.models.loading import load_causal_lm, load_tokenizer
from rlhf.repulse.gcg import (
    AttackPrompt,
    disallowed_token_ids,
    filter_round_trip,
    gcg_step,
    init_state,
    initial_suffix_ids,
    mellowmax_loss_B,
    run_gcg,
    sample_candidates_WL,
    target_loss_B,
    token_gradients_LV,
)
from rlhf.repulse.gcg_config import EMBEDDED_GCG_GOALS, EvaluateGCGConfig, GCGDataConfig, GCGSearchConfig
from rlhf.repulse.gcg_run import load_goals, policy_weights_dir
from tests.tiny_runs import run_gcg_cli

SMALL = ["--max_targets", "2", "--gcg_steps", "1", "--gcg_search_width", "8", "--gcg_suffix_len", "6",
         "--samples_per_goal", "3", "--max_new_tokens", "6"]


@pytest.fixture(scope="module")
def tiny():
    tokenizer = load_tokenizer(EMBEDDED_MODEL_DIR)
    model = load_causal_lm(EMBEDDED_MODEL_DIR, torch.float32, "sdpa").eval().requires_grad_(False)
    return model, tokenizer


def _ids(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"] if text else [], dtype=torch.long)


def _prompt(tokenizer, goal="q copy 5 :", after="assistant :", target="7 7 7") -> AttackPrompt:
    return AttackPrompt(_ids(tokenizer, goal), _ids(tokenizer, after), _ids(tokenizer, target))


def _hand_logprobs(model, prompt: AttackPrompt, suffix_L: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(target token j | prefix) for each j, and the logits predicting them, from one plain forward."""
    ids = torch.cat([prompt.prompt_ids(suffix_L), prompt.target_ids])
    logits = model(input_ids=ids[None]).logits[0].float()
    start = ids.numel() - prompt.target_ids.numel()
    rows = torch.arange(start - 1, ids.numel() - 1)
    return torch.log_softmax(logits, -1)[rows, prompt.target_ids], logits[rows, prompt.target_ids]


# --- the pure pieces ------------------------------------------------------------------------------

def test_target_loss_is_the_mean_target_nll_of_each_candidate(tiny):
    model, tok = tiny
    prompt = _prompt(tok)
    suffix_BL = torch.randint(4, 64, (3, 5), generator=torch.Generator().manual_seed(0))
    got = target_loss_B(model, prompt, suffix_BL, batch_size=2)
    hand = torch.stack([-_hand_logprobs(model, prompt, s)[0].mean() for s in suffix_BL])
    assert torch.allclose(got, hand, atol=1e-5), (got, hand)
    assert got.min() > 0 and got.std() > 0
    # mellowmax of the negated target logits: (log sum exp(alpha x) - log N) / alpha
    mellow = target_loss_B(model, prompt, suffix_BL[:1], functools.partial(mellowmax_loss_B, alpha=2.0))
    x = -_hand_logprobs(model, prompt, suffix_BL[0])[1]
    assert torch.allclose(mellow, ((torch.exp(2.0 * x).sum().log() - torch.log(torch.tensor(3.0))) / 2.0)[None],
                          atol=1e-5)


def test_one_hot_gradient_matches_autograd_and_central_differences(tiny):
    model, tok = tiny
    model64 = copy.deepcopy(model).double()
    prompt = _prompt(tok)
    suffix_L = torch.tensor([42, 17, 30, 42])
    grad_LV = token_gradients_LV(model64, prompt, suffix_L)
    assert grad_LV.shape == (4, 64) and grad_LV.abs().max() > 0
    E_VD = model64.get_input_embeddings().weight

    def loss(suffix_embeds_LD: torch.Tensor) -> torch.Tensor:
        embeds = torch.cat([E_VD[prompt.before_ids], suffix_embeds_LD, E_VD[prompt.after_ids], E_VD[prompt.target_ids]])
        logits = model64(inputs_embeds=embeds[None]).logits[0]
        n = prompt.target_ids.numel()
        logp = torch.log_softmax(logits[-n - 1:-1], -1)
        return -logp[torch.arange(n), prompt.target_ids].mean()

    suffix_embeds = E_VD[suffix_L].clone().requires_grad_(True)
    with torch.enable_grad():
        (g_LD,) = torch.autograd.grad(loss(suffix_embeds), [suffix_embeds])
    assert torch.allclose(grad_LV.double(), g_LD @ E_VD.T, rtol=1e-5, atol=1e-9)
    eps = 1e-3  # Llama's RMSNorm computes in float32 even in a float64 model: smaller steps drown in its rounding
    for pos, tok_id in ((0, 12), (2, 55), (3, 42)):
        step = torch.zeros_like(suffix_embeds)
        step[pos] = eps * E_VD[tok_id]
        with torch.no_grad():
            fd = (loss(E_VD[suffix_L] + step) - loss(E_VD[suffix_L] - step)) / (2 * eps)
        assert abs(float(fd) - float(grad_LV[pos, tok_id])) < 1e-5 + 1e-3 * abs(float(fd)), (pos, tok_id, fd)


def test_candidates_change_exactly_n_replace_positions_to_top_k_tokens():
    g = torch.Generator().manual_seed(1)
    L, V, topk, n_replace = 6, 20, 3, 2
    grad_LV = torch.randn(L, V, generator=g)
    suffix_L = torch.tensor([5, 9, 5, 12, 4, 7])
    disallowed = torch.tensor([0, 1, 2, 3])
    cands = sample_candidates_WL(suffix_L, grad_LV, search_width=200, topk=topk, n_replace=n_replace,
                                 disallowed_ids=disallowed, generator=g)
    assert cands.shape == (200, L)
    allowed_top = []
    for pos in range(L):
        order = [int(v) for v in torch.argsort(grad_LV[pos]) if int(v) not in (0, 1, 2, 3, int(suffix_L[pos]))]
        allowed_top.append(set(order[:topk]))
    for row in cands:
        changed = (row != suffix_L).nonzero().flatten().tolist()
        assert len(changed) == n_replace
        assert all(int(row[p]) in allowed_top[p] for p in changed)
    assert set(cands[cands != suffix_L].tolist()) <= set().union(*allowed_top)
    assert len({tuple(r) for r in cands.tolist()}) > 20  # random positions and picks, not one candidate
    # a top-k beyond the allowed tokens is capped: every allowed token but the current one can appear
    wide = sample_candidates_WL(suffix_L, grad_LV, search_width=500, topk=1000, n_replace=1,
                                disallowed_ids=disallowed, generator=g)
    assert not set(wide.flatten().tolist()) & {0, 1, 2, 3} and ((wide != suffix_L).sum(1) == 1).all()


class _CharTokenizer:
    """Tokens a, b, ab, c; text is the tokens joined without spaces, encoding is greedy longest match."""

    vocab = ["a", "b", "ab", "c"]

    def batch_decode(self, rows):
        return ["".join(self.vocab[i] for i in row) for row in rows]

    def __call__(self, texts, add_special_tokens=False):
        out = []
        for text in texts:
            ids, i = [], 0
            while i < len(text):
                if text.startswith("ab", i):
                    ids.append(2)
                    i += 2
                else:
                    ids.append(self.vocab.index(text[i]))
                    i += 1
            out.append(ids)
        return {"input_ids": out}


def test_filter_keeps_only_candidates_that_survive_decode_and_encode(tiny):
    cands = torch.tensor([[0, 1], [2, 3], [3, 0], [0, 3], [1, 0]])  # "ab" re-encodes as one token: dropped
    assert filter_round_trip(cands, _CharTokenizer()).tolist() == [[2, 3], [3, 0], [0, 3], [1, 0]]
    _, tok = tiny
    words = torch.tensor([[42, 12, 30], [4, 4, 4]])  # the word-level tokenizer round-trips words
    assert filter_round_trip(words, tok).tolist() == words.tolist()


def test_the_suffix_starts_as_x_where_the_vocabulary_has_no_bang(tiny):
    _, tok = tiny
    disallowed = disallowed_token_ids(tok, 64)
    assert disallowed.tolist() == [0, 1, 2, 3]  # the special tokens; every word is printable ASCII
    init = initial_suffix_ids(tok, 5, disallowed)
    assert tok.decode(init.tolist()) == "x x x x x"


@pytest.mark.parametrize("buffer_size", [0, 1, 3])
def test_a_gcg_step_never_increases_the_best_loss(tiny, buffer_size):
    model, tok = tiny
    prompt = _prompt(tok)
    disallowed = disallowed_token_ids(tok, 64)
    search = GCGSearchConfig(num_steps=4, search_width=16, topk=8, suffix_len=6, buffer_size=buffer_size)
    g = torch.Generator().manual_seed(3)
    rows = torch.cat([initial_suffix_ids(tok, 6, disallowed)[None], torch.randint(4, 64, (max(0, buffer_size - 1), 6),
                                                                                   generator=g)])
    state = init_state(model, prompt, rows, buffer_size)
    assert len(state.buffer) == max(1, buffer_size)
    first = state.best_loss
    for _ in range(search.num_steps):
        new = gcg_step(model, prompt, state, search, disallowed_ids=disallowed, generator=g, tokenizer=tok)
        assert new.best_loss <= state.best_loss and new.steps == state.steps + 1
        if buffer_size >= 1:  # the buffer keeps the lowest losses: the suffix searched from never gets worse
            assert new.buffer[0][0] <= state.buffer[0][0]
        assert ((new.current_ids_L != state.current_ids_L).sum() in (0, 1))
        state = new
    recomputed = target_loss_B(model, prompt, state.best_ids_L[None])
    assert abs(float(recomputed) - state.best_loss) < 1e-5
    assert state.best_loss < first  # 64 candidates over 4 steps find a better suffix on the tiny model


def test_run_gcg_lowers_the_loss_and_early_stop_ends_it(tiny):
    model, tok = tiny
    prompt = _prompt(tok, after="", target="7")
    disallowed = disallowed_token_ids(tok, 64)
    init = initial_suffix_ids(tok, 4, disallowed)
    before = float(target_loss_B(model, prompt, init[None]))
    search = GCGSearchConfig(num_steps=6, search_width=32, topk=16, suffix_len=4)
    state = run_gcg(model, prompt, init, search, disallowed_ids=disallowed, generator=torch.Generator().manual_seed(0))
    assert state.steps == 6 and state.best_loss < before
    stopping = GCGSearchConfig(num_steps=50, search_width=32, topk=60, suffix_len=4, early_stop=True)
    state = run_gcg(model, prompt, init, stopping, disallowed_ids=disallowed,
                    generator=torch.Generator().manual_seed(0))
    assert state.target_hit and state.steps < 50  # a one-token target is greedily hit within a few steps


# --- config ---------------------------------------------------------------------------------------

def parse(*argv: str) -> EvaluateGCGConfig:
    return parse_config(EvaluateGCGConfig, list(argv), prog="evaluate_gcg")


def test_defaults_are_the_forks_and_the_demo_fills_in_the_tiny_models():
    cfg = parse()
    assert (cfg.seed, cfg.search.num_steps, cfg.search.search_width, cfg.search.topk, cfg.search.n_replace,
            cfg.search.buffer_size, cfg.search.filter_ids, cfg.success.max_new_tokens, cfg.success.reward_threshold,
            cfg.success.num_samples, cfg.model.dtype) == (42, 250, 512, 256, 1, 0, True, 20, -5.0, 1000, torch.float32)
    demo = cfg.with_demo_defaults()
    assert demo.model.pretrain == EMBEDDED_MODEL_DIR and demo.data.file_path == EMBEDDED_GCG_GOALS
    assert (demo.search.num_steps, demo.success.num_samples, demo.success.reward_threshold) == (10, 8, 0.25)
    mine = parse("--remote_rm_url", "r.py", "--gcg_steps", "3", "--samples_per_prompt", "5").with_demo_defaults()
    assert (mine.search.num_steps, mine.success.num_samples, mine.success.reward_threshold) == (3, 5, -5.0)
    assert parse("--bf16").model.dtype == torch.bfloat16
    names = [s.flag for s in flag_specs(EvaluateGCGConfig)]
    assert len(names) == len(set(names)) and "gcg_steps" in names and "samples_per_goal" in names


@pytest.mark.parametrize("argv,message", [
    (["--gcg_n_replace", "30"], "--gcg_n_replace 30 exceeds the 20 suffix positions"),
    (["--atk_success_criteria", "prefix"], "choose reward"),
    (["--reward_pretrain", "a", "--remote_rm_url", "b.py"], "give one reward source"),
    (["--load_checkpoint"], "--load_checkpoint needs --ckpt_path"),
    (["--bf16", "--param_dtype", "fp32"], "--bf16 contradicts --param_dtype fp32"),
    (["--scenario", "prompts"], "--scenario 'prompts'"),
    (["--samples_per_goal", "4", "--samples_per_prompt", "8"], "--samples_per_goal 4 contradicts"),
])
def test_bad_flags_name_the_fix(argv, message):
    with pytest.raises(UsageError, match=message):
        parse(*argv)


def test_pretrain_needs_goals_and_a_reward_and_fork_flags_are_noted():
    with pytest.raises(UsageError, match="--file_path is not"):
        parse("--pretrain", EMBEDDED_MODEL_DIR).with_demo_defaults()
    with pytest.raises(UsageError, match="needs a reward"):
        parse("--pretrain", EMBEDDED_MODEL_DIR, "--file_path", EMBEDDED_GCG_GOALS).with_demo_defaults()
    with pytest.warns(UserWarning, match="--zero_stage, --adam_offload: no effect"):
        parse("--zero_stage", "2", "--adam_offload")
    with pytest.warns(UserWarning, match="--gcg_use_prefix_cache is not needed"):
        parse("--gcg_use_prefix_cache")
    # the fork's evaluate_gcg uses these only for a non-policy parameterization's head, or not at all
    with pytest.warns(UserWarning, match="--actor_modulates_base: no effect"):
        parse("--actor_modulates_base")
    with pytest.warns(UserWarning, match="--additional_sd_divider, --init_head_from_base: no effect: the fork "
                                         "applies them to the head of a non-policy --parameterization"):
        parse("--additional_sd_divider", "2", "--init_head_from_base")
    with pytest.raises(UsageError, match="--reward_normalize normalises reward models' scores .* drop "
                                         "--reward_normalize"):
        parse("--remote_rm_url", "r.py", "--reward_normalize")


def test_reward_normalize_uses_the_reward_models_stored_statistics(tmp_path):
    """--reward_normalize scores with (reward - mean) / std from the reward model's config (the fork's
    normalize_reward); a model without them is refused by name."""
    import shutil

    from rlhf.assets import EMBEDDED_REWARD_MODEL_DIR
    from rlhf.repulse.gcg_run import build_reward
    from rlhf.rewards.base import RewardInputs

    rm = tmp_path / "rm"
    shutil.copytree(EMBEDDED_REWARD_MODEL_DIR, rm)
    tok = load_tokenizer(EMBEDDED_MODEL_DIR)
    ids = torch.tensor([tok("q copy 5 : 5 5 5")["input_ids"], tok("q copy 5 : 7 1 2")["input_ids"]])
    inputs = RewardInputs(["", ""], ["", ""], [None, None], ids, torch.ones_like(ids))
    cpu = torch.device("cpu")

    def rewards(*flags):
        source = build_reward(parse("--reward_pretrain", str(rm), *flags).with_demo_defaults(), tok, cpu, "sdpa")
        return source.score(inputs).rewards_B

    raw = rewards()
    with pytest.raises(UsageError, match=f"--reward_normalize: --reward_pretrain {rm} stores no reward mean/std"):
        rewards("--reward_normalize")
    config = json.loads((rm / "config.json").read_text())
    (rm / "config.json").write_text(json.dumps({**config, "mean": 0.25, "std": 0.5}))
    torch.testing.assert_close(rewards("--reward_normalize"), (raw - 0.25) / 0.5)
    torch.testing.assert_close(rewards(), raw)


def test_goal_files_and_checkpoint_paths_are_checked(tmp_path):
    data = GCGDataConfig()
    with pytest.raises(UsageError, match=r"--file_path .*missing.csv: file not found; give a CSV with the header "
                                         "goal,target"):
        load_goals(str(tmp_path / "missing.csv"), data)
    bad = tmp_path / "bad.csv"
    bad.write_text("prompt,answer\nq copy 5 :,7 7\n")
    with pytest.raises(UsageError, match=r"--file_path .*bad.csv: its header is prompt,answer; a GCG goals file for "
                                         "--scenario behaviors needs the columns goal,target"):
        load_goals(str(bad), data)
    strings = tmp_path / "strings.csv"
    strings.write_text("target\n7 7\n1 1\n2 2\n")
    goals = load_goals(str(strings), GCGDataConfig(scenario="strings", max_targets=2))
    assert [(g.goal, g.target, g.row) for g in goals] == [("", "7 7", 2), ("", "1 1", 3)]
    assert policy_weights_dir(parse("--ckpt_path", EMBEDDED_MODEL_DIR)) == EMBEDDED_MODEL_DIR
    with pytest.raises(UsageError, match="is not an HF model directory"):
        policy_weights_dir(parse("--load_checkpoint", "--ckpt_path", str(tmp_path)))


# --- end to end -----------------------------------------------------------------------------------

def test_cli_on_the_embedded_defaults_writes_a_consistent_result(tmp_path):
    stdout = run_gcg_cli(["--save_path", str(tmp_path), *SMALL, "--gcg_steps", "2", "--samples_per_goal", "4"])
    result = json.loads((tmp_path / "gcg.json").read_text())
    goals = result["goals"]
    assert result["num_goals"] == len(goals) == 2 and 0.0 <= result["attack_success_rate"] <= 1.0
    assert result["attack_success_rate"] == sum(g["attacked"] for g in goals) / 2
    for g in goals:
        assert len(g["rewards"]) == 4 and len(g["suffix_ids"]) == 6 and g["final_loss"] > 0
        assert g["attacked"] == any(r < 0.25 for r in g["rewards"])  # the demo's --reward_threshold
    assert [g["goal"] for g in goals] == ["q copy 5 :", "b i copy 3 :"]
    assert "attack success rate" in stdout


REWARD_FUNC = """
def reward_func(queries, prompts, labels):
    assert all(q.startswith(p) and len(q) > len(p) for q, p in zip(queries, prompts)), (queries, prompts)
    assert all(label is None for label in labels)
    return [{body} for q, p in zip(queries, prompts)]
"""


@pytest.mark.parametrize("body,exclude,rate", [
    ("-10.0", False, 1.0),
    ("10.0", False, 0.0),
    ("-10.0 if ' x' in p else 10.0", False, 1.0),  # the prompt scored holds the suffix ...
    ("-10.0 if ' x' in p else 10.0", True, 0.0),   # ... unless --rm_exclude_adv_suffix
])
def test_reward_func_rewards_decide_the_attack_success_rate(tmp_path, body, exclude, rate):
    func = tmp_path / "reward.py"
    func.write_text(REWARD_FUNC.format(body=body))
    out = tmp_path / "res" / "gcg.json"
    run_gcg_cli([*SMALL, "--remote_rm_url", str(func), "--output_path", str(out),
                 *(["--rm_exclude_adv_suffix"] * exclude)])
    result = json.loads(out.read_text())
    assert result["attack_success_rate"] == rate and result["reward_threshold"] == -5.0
    assert all(len(g["rewards"]) == 3 for g in result["goals"])


def test_bad_inputs_exit_with_one_error_line(tmp_path, capsys):
    bad = tmp_path / "goals.csv"
    bad.write_text("question,answer\nq copy 5 :,7 7\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["--file_path", str(bad), "--save_path", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"error: --file_path {bad}: its header is question,answer" in err
    with pytest.raises(SystemExit):
        main(["--file_path", str(tmp_path / "none.csv"), "--save_path", str(tmp_path)])
    assert "file not found" in capsys.readouterr().err
