"""Every family of the tiny zoo (`rlhf.models.zoo`) on the single-process paths: the tokenizer's special-token
behaviour, packed == padded (log-probs, entropy, every gradient; reward-model scores), multi-turn chat SFT with loss
on assistant tokens only, the stop tokens of a rollout, the HF export reloaded by transformers, and the weight
stream in the checkpoint layout vLLM reads. Each test's results per family feed the README's compatibility table
(`tests/family_table.py`).

Reproduced failures of the code before this file: Mistral and Gemma-2 packed forwards raised "rlhf_varlen attention
does not implement sliding-window attention"; Gemma-2's padded forward on SDPA dropped the soft-cap (log-probs off
by 0.33); Mixtral's pushed weights carried names vLLM does not know (`mlp.experts.gate_up_proj`)."""

from __future__ import annotations

import pytest
import torch

from rlhf.models.zoo import FAMILIES, family

NAMES = list(FAMILIES)
RM_FAMILIES = EXPORT_FAMILIES = NAMES
MOE_FAMILIES = [n for n in NAMES if family(n).moe]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """Every family built once into a temporary directory: name -> path."""
    from rlhf.models.zoo import build_family

    root = tmp_path_factory.mktemp("zoo")
    return {name: build_family(name, str(root / name)) for name in NAMES}


def _batch(vocab: int):
    """Three right-padded rows of 5, 19 and 13 tokens (longer than the zoo's 8-token sliding window)."""
    g = torch.Generator().manual_seed(0)
    lengths, T = torch.tensor([5, 19, 13]), 19
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    return torch.randint(3, vocab, (3, T), generator=g) * mask, mask


@pytest.mark.parametrize("name", NAMES)
def test_tokenizer_special_tokens_follow_the_family(zoo, name):
    from rlhf.engines.hf_engine import stop_token_ids
    from rlhf.models.loading import load_tokenizer

    fam, tok = family(name), load_tokenizer(zoo[name])
    ids = tok("copy 5")["input_ids"]
    assert (fam.bos is not None and ids[0] == tok.convert_tokens_to_ids(fam.bos)) == fam.add_bos
    assert tok.eos_token == fam.eos and tok.pad_token == (fam.pad or fam.eos)  # no pad: EOS pads (as OpenRLHF)
    expected_stops = {tok.convert_tokens_to_ids(t) for t in (fam.eos, *fam.generation_eos)}
    assert set(stop_token_ids(zoo[name], tok)) == expected_stops
    assert tok.convert_tokens_to_ids(fam.turn_end) in expected_stops
    chat = tok.apply_chat_template([{"role": "user", "content": "copy 5"}], tokenize=False, add_generation_prompt=True)
    chat_ids = tok(chat, add_special_tokens=False)["input_ids"]
    if fam.bos and fam.add_bos:  # the template writes BOS; encoding it again with special tokens doubles it
        bos = tok.convert_tokens_to_ids(fam.bos)
        assert chat_ids.count(bos) == 1 and tok(chat)["input_ids"][:2] == [bos, bos]


@pytest.mark.parametrize("name", NAMES)
def test_packed_equals_padded_logprobs_entropy_and_gradients(zoo, name):
    from rlhf.models.layout import PADDED, SequenceLayout
    from rlhf.models.lm_logprobs import policy_forward
    from rlhf.models.loading import load_causal_lm

    results = []
    for layout in (PADDED, SequenceLayout(packing=True)):
        model = load_causal_lm(zoo[name], torch.float32, layout.attn_implementation("sdpa"))
        ids, mask = _batch(model.config.vocab_size)
        out = policy_forward(model, ids, mask, temperature=0.9, with_entropy=True, layout=layout)
        ((out.logprobs_BT1 + 0.3 * out.entropy_BT1) * mask[:, 1:]).sum().backward()
        results.append((out.logprobs_BT1.detach() * mask[:, 1:], out.entropy_BT1.detach() * mask[:, 1:],
                        {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (lp, ent, grads), (lp_packed, ent_packed, grads_packed) = results
    torch.testing.assert_close(lp_packed, lp, atol=2e-5, rtol=0)
    torch.testing.assert_close(ent_packed, ent, atol=2e-5, rtol=0)
    assert grads.keys() == grads_packed.keys() and len(grads) > 10
    for key, grad in grads.items():
        torch.testing.assert_close(grads_packed[key], grad, atol=2e-5, rtol=1e-4, msg=key)


def test_gemma2_padded_forward_keeps_the_softcap(zoo):
    """transformers' SDPA attention drops Gemma-2's soft-cap: the loader runs eager attention instead, which
    equals the packed kernel (above); the raw SDPA forward is measurably different."""
    from transformers import AutoModelForCausalLM

    from rlhf.models.loading import exact_attention, load_causal_lm

    assert exact_attention(zoo["gemma2"], "sdpa") == "eager" and exact_attention(zoo["mistral"], "sdpa") == "sdpa"
    ours = load_causal_lm(zoo["gemma2"], torch.float32, "sdpa")
    raw = AutoModelForCausalLM.from_pretrained(zoo["gemma2"], dtype=torch.float32, attn_implementation="sdpa")
    ids, mask = _batch(ours.config.vocab_size)
    with torch.no_grad():
        gap = (ours(ids, attention_mask=mask).logits - raw(ids, attention_mask=mask).logits).abs().max()
    assert float(gap) > 0.05


@pytest.mark.parametrize("name", RM_FAMILIES)
def test_packed_reward_scores_equal_padded(zoo, name):
    from rlhf.models.layout import PADDED, SequenceLayout
    from rlhf.models.value import last_token_values, load_scalar_head_model, token_values

    scores = []
    for layout in (PADDED, SequenceLayout(packing=True)):
        model = load_scalar_head_model(zoo[name], "score", torch.float32, layout.attn_implementation("sdpa"),
                                       fresh_head=True)
        ids, mask = _batch(model.config.vocab_size)
        with torch.no_grad():
            scores.append(last_token_values(token_values(model, ids, mask, layout), mask))
    torch.testing.assert_close(scores[1], scores[0], atol=1e-5, rtol=0)
    assert float(scores[0].std()) > 0


@pytest.mark.parametrize("name", NAMES)
def test_multiturn_chat_sft_targets_only_assistant_tokens(zoo, name):
    """Two user/assistant exchanges with --apply_chat_template --multiturn: the loss covers exactly each answer and
    the template's turn end after it (plus the EOS the sample ends with), never a user turn; BOS appears once."""
    from rlhf.data.sources import Row
    from rlhf.data.supervised_samples import load_sft_samples
    from rlhf.models.loading import load_tokenizer

    fam, tok = family(name), load_tokenizer(zoo[name])
    messages = [{"role": "user", "content": "copy 3"}, {"role": "assistant", "content": "3 3 3"},
                {"role": "user", "content": "copy 7"}, {"role": "assistant", "content": "7 7"}]
    samples, _ = load_sft_samples([Row("chat.jsonl", 1, {"messages": messages})], tok, input_key="messages",
                                  output_key=None, input_template=None, apply_chat_template=True, multiturn=True,
                                  pretrain_mode=False, max_len=256)
    ids, mask = samples[0].input_ids.tolist(), samples[0].loss_mask.tolist()
    targets = [ids[t + 1] for t, on in enumerate(mask) if on]
    target_text = tok.decode(targets)
    assert "3 3 3" in target_text and "7 7" in target_text and "copy" not in target_text, target_text
    assert tok.decode(ids[1:]).count("copy") == 2  # the user turns are in the input, not in the targets
    if fam.bos:
        assert ids.count(tok.convert_tokens_to_ids(fam.bos)) == (1 if "bos_token" in fam.chat_template else 0)
    turn_end = tok.convert_tokens_to_ids(fam.turn_end)
    assert targets.count(turn_end) >= 2 and targets[-1] == tok.eos_token_id


def test_hf_engine_stops_on_the_chat_turn_end(zoo):
    """Gemma-2's chat turn ends with <end_of_turn>, not its tokenizer's <eos>: the HF rollout engine stops on
    both (as vLLM, which reads generation_config.json), so no sample runs past a turn end."""
    from rlhf.engines.hf_engine import HFGenerateEngine, stop_token_ids
    from rlhf.engines.rollout import SamplingSpec
    from rlhf.models.loading import load_tokenizer

    tok = load_tokenizer(zoo["gemma2"])
    stops = stop_token_ids(zoo["gemma2"], tok)
    engine = HFGenerateEngine(zoo["gemma2"], dtype=torch.float32, device=torch.device("cpu"), eos_token_id=stops,
                              pad_token_id=tok.pad_token_id)
    prompt = tok(tok.apply_chat_template([{"role": "user", "content": "copy 3"}], tokenize=False,
                                         add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    gens = engine.generate([prompt] * 4, SamplingSpec(n=8, temperature=1.0, top_p=1.0, max_tokens=40),
                           [1, 2, 3, 4])
    flat = [g for per_prompt in gens for g in per_prompt]
    turn_end = tok.convert_tokens_to_ids("<end_of_turn>")
    assert sum(g.finish_reason == "stop" and g.token_ids[-1] == turn_end for g in flat) >= 1
    assert all(t not in stops for g in flat for t in g.token_ids[:-1])
    assert all((g.finish_reason == "stop") == (g.token_ids[-1] in stops) for g in flat)


@pytest.mark.parametrize("name", EXPORT_FAMILIES)
def test_hf_export_reloads_and_the_weight_stream_has_checkpoint_names(zoo, name, tmp_path):
    """A moved model saved as the actor's HF export is (`save_pretrained_on_this_rank`) reloads with the same
    logits, and `CheckpointLayout` turns the in-memory tensors (transformers 5 fuses MoE experts) into exactly the
    tensors of that checkpoint file, which is what vLLM's loader reads."""
    from safetensors.torch import load_file

    from rlhf.engines.deepspeed_engine import save_pretrained_on_this_rank
    from rlhf.engines.weight_sync import CheckpointLayout
    from rlhf.models.loading import load_causal_lm

    model = load_causal_lm(zoo[name], torch.float32, "sdpa")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    save_pretrained_on_this_rank(model, str(tmp_path), {k: v.detach() for k, v in model.state_dict().items()})
    again = load_causal_lm(str(tmp_path), torch.float32, "sdpa")
    ids, mask = _batch(model.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(again(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits)
    on_disk = load_file(str(tmp_path / "model.safetensors"))
    streamed = dict(CheckpointLayout(zoo[name])((n, p.detach()) for n, p in model.named_parameters()))
    assert streamed.keys() == on_disk.keys()
    for key, tensor in on_disk.items():
        torch.testing.assert_close(streamed[key], tensor, atol=0, rtol=0, msg=key)
    fused = [n for n, _ in model.named_parameters() if n.endswith("experts.gate_up_proj")]
    assert bool(fused) == family(name).moe and not any("gate_up_proj" in k and "experts" in k for k in streamed)


@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_router_aux_loss_is_returned_and_packed_equals_padded(zoo, name):
    """--aux_loss_coef > 0 turns on the MoE router's load-balancing loss (off in the families' configs): the forward
    returns it, packed == padded (padding is masked out of it), and it reaches the router weights; on a dense model
    the flag is warned about, never silently dropped."""
    from rlhf.models.layout import PADDED, SequenceLayout
    from rlhf.models.lm_logprobs import policy_forward
    from rlhf.models.loading import load_causal_lm, with_router_aux_loss

    losses = []
    for layout in (PADDED, SequenceLayout(packing=True)):
        model = load_causal_lm(zoo[name], torch.float32, layout.attn_implementation("sdpa"))
        assert policy_forward(model, *_batch(model.config.vocab_size), layout=layout).aux_loss is None
        with_router_aux_loss(model, 0.01)
        out = policy_forward(model, *_batch(model.config.vocab_size), layout=layout)
        out.aux_loss.backward()
        router = [p.grad for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")]
        assert router and all(float(g.abs().sum()) > 0 for g in router)
        losses.append(out.aux_loss.detach())
    torch.testing.assert_close(losses[1], losses[0], atol=1e-6, rtol=1e-6)
    assert float(losses[0]) > 0
    dense = load_causal_lm(zoo["llama3"], torch.float32, "sdpa")
    with pytest.warns(UserWarning, match="--aux_loss_coef 0.01 has no effect: llama is not a mixture-of-experts"):
        with_router_aux_loss(dense, 0.01)


@pytest.mark.parametrize("name", NAMES)
def test_lora_train_step_and_merge_equal_the_adapted_model(zoo, name):
    """LoRA (OpenRLHF's all-linear targets) on every family: a step moves only the adapters; the merged weights,
    under the base model's own names (what the vLLM push and the HF export carry), give the adapted model's
    logits. MoE experts are fused 3-D parameters in transformers 5, not linear layers: peft adapts them (and the
    router) as parameters (`ParamWrapper`, nested when one module holds two), and every delta is merged."""
    from contextlib import nullcontext

    from rlhf.config.shared_config import LoRAConfig
    from rlhf.models.loading import load_causal_lm
    from rlhf.models.lora import apply_lora, merged_parameters

    base = load_causal_lm(zoo[name], torch.float32, "sdpa")
    names = [n for n, _ in base.named_parameters()]
    adapted = apply_lora(load_causal_lm(zoo[name], torch.float32, "sdpa"), LoRAConfig(lora_rank=4))
    ids, mask = _batch(base.config.vocab_size)
    trainable = [p for p in adapted.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    adapted(ids, attention_mask=mask).logits.logsumexp(-1).mean().backward()
    optimizer.step()
    assert trainable and all(float(p.grad.abs().sum()) > 0 for p in trainable if ".lora_A." in str(p))
    merged = dict(merged_parameters(adapted, lambda params: nullcontext()))
    assert list(merged) == names  # tied output weights come once, as the unadapted model names them
    missing, unexpected = base.load_state_dict(merged, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    with torch.no_grad():
        want, got = adapted(ids, attention_mask=mask).logits, base(ids, attention_mask=mask).logits
        moved = (got - load_causal_lm(zoo[name], torch.float32, "sdpa")(ids, attention_mask=mask).logits).abs().max()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert float(moved) > 1e-3  # the adapters changed the model


def test_readme_family_table_is_the_one_these_tests_prove():
    """README's compatibility table equals the one `tests/family_matrix.py` derives from the tests' own family
    lists, and every test it names exists."""
    import importlib
    import os

    from tests.distributed import ROOT
    from tests.family_matrix import BEGIN, END, rows, table

    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    assert BEGIN in readme and END in readme
    assert readme.split(BEGIN)[1].split(END)[0].strip() == table(), "run PYTHONPATH=. python tests/family_matrix.py"
    for row in rows():
        path, function = row.test.split("::")
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        assert callable(getattr(module, function, None)), row.test
        assert set(row.families) <= set(FAMILIES), row


def test_attention_sinks_are_refused_before_weights_load(tmp_path):
    """gpt-oss adds learned sinks to attention, which the packed kernels do not implement: one UsageError naming the
    family and the flags to drop, from the config alone (the directory holds no weights at all)."""
    from transformers import GptOssConfig

    from rlhf.config.errors import UsageError
    from rlhf.models.attention import VARLEN_ATTENTION
    from rlhf.models.loading import check_packed_attention

    GptOssConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                 head_dim=32).save_pretrained(tmp_path)
    with pytest.raises(UsageError, match="gpt_oss attention has learned sinks.*drop --packing_samples and "
                                         "--ring_attn_size"):
        check_packed_attention(str(tmp_path), VARLEN_ATTENTION)
    check_packed_attention(str(tmp_path), "sdpa")  # padded forwards: transformers' own attention runs the sinks


@pytest.mark.parametrize("name", ["qwen3-moe", "mixtral", "llama3"])
def test_zero3_marks_sparse_moe_blocks_as_leaf_modules(zoo, name):
    """As OpenRLHF: ZeRO-3 gathers a sparse MoE block whole at its entry (DeepSpeed's z3 leaf modules); dense
    models have none."""
    from deepspeed.utils import z3_leaf_module

    from rlhf.engines.deepspeed_engine import mark_moe_leaf_modules
    from rlhf.models.loading import load_causal_lm

    model = load_causal_lm(zoo[name], torch.float32, "sdpa")
    marked = mark_moe_leaf_modules(model)
    leaves = [n for n, m in model.named_modules() if z3_leaf_module(m)]
    assert bool(marked) == family(name).moe
    assert leaves == ([f"model.layers.{i}.mlp" for i in range(2)] if family(name).moe else [])


def test_a_shape_with_more_layers_repeats_the_familys_attention_pattern(tmp_path):
    """tests/gpu builds Gemma-3 with 4 layers; its family's 2-entry `layer_types` made transformers refuse the
    config (`num_hidden_layers` (4) must be equal to the number of `layer_types` (2))."""
    from rlhf.models.zoo import build_tokenizer, model_config

    fam = family("gemma3")
    tok = build_tokenizer(fam, str(tmp_path))
    config = model_config(fam, tok, {"num_hidden_layers": 5})
    assert config.layer_types == ["sliding_attention", "full_attention"] * 2 + ["sliding_attention"]
    assert model_config(fam, tok).layer_types == ["sliding_attention", "full_attention"]
