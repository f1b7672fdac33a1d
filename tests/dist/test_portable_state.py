"""A trained model's state moves between layouts bit for bit (`rlhf.engines.portable_state` through
`DeepSpeedModel.load_state`): saved after two AdamW steps on 2 ranks at ZeRO-0 (fp32), ZeRO-2 and ZeRO-3, loaded
on 1 rank at ZeRO-0, -1 and -3 (ZeRO-0 to ZeRO-0 by DeepSpeed's own loader: its state is whole), and with
--use_ds_universal_ckpt on 2 ranks at the saved stage, every fp32 master weight, both Adam moments, the Adam step and
the LR schedule equal the saved ones exactly; the next step equals the unmoved run's next step to float rounding
(`assert_next_step_close`); the same for LoRA adapters (ZeRO-2 -> ZeRO-3, ZeRO-3 -> ZeRO-0). A move out of ZeRO-0 in
bf16 and one with an EMA are refused by name. A tensor-parallel state resumes at its own layout bit for bit and moves
to another tensor-parallel size (and back, and from ZeRO-0) the same way."""

from __future__ import annotations

import os

import torch

from tests.distributed import run_variants_on_ranks

SAVED = (0, 2, 3)
LOADED = (0, 1, 3)


def tiny_model(zero_stage: int, dp_group=None, bf16: bool = False, ema: float | None = None):
    import torch.distributed as dist

    from rlhf.config.shared_config import EngineConfig, OptimConfig
    from rlhf.engines.deepspeed_engine import DeepSpeedModel

    def build() -> torch.nn.Module:
        """93 weights: the 3-element bias pads ZeRO-3's 2-rank partitions. At ZeRO-3 the module is built inside
        transformers' `no_init_weights` (a from_pretrained model's weights come from its files), so its values
        are set here, through a gather, or they would be whatever memory held (non-finite, now and then)."""
        import deepspeed

        module = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))
        params = list(module.parameters())
        gen = torch.Generator().manual_seed(0)
        partitioned = hasattr(params[0], "ds_id")
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0, enabled=partitioned), torch.no_grad():
            for p in params:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
        return module

    return DeepSpeedModel(build, EngineConfig(zero_stage=zero_stage), OptimConfig(lr_warmup_ratio=0.5),
                          learning_rate=1e-2, bf16=bf16, micro_batch_size=4 // dist.get_world_size(),
                          grad_accum_steps=1, num_optimizer_steps=4, device=torch.device("cpu"),
                          dp_group=dp_group or dist.group.WORLD, ema_beta=ema)


def train_steps(model, steps: int, first: int = 0) -> None:
    """`steps` optimizer steps of 4 samples split over the ranks (token ids into a LoRA language model)."""
    import torch.distributed as dist

    dp, rank = dist.get_world_size(), dist.get_rank()
    for step in range(first, first + steps):
        gen = torch.Generator().manual_seed(step)
        if model.adapted:
            x = torch.randint(0, 64, (4, 8), generator=gen)
            out = model.engine(input_ids=x[rank * 4 // dp:(rank + 1) * 4 // dp]).logits
        else:
            x = torch.randn(4, 6, generator=gen)
            out = model.engine(x[rank * 4 // dp:(rank + 1) * 4 // dp].to(next(model.module.parameters()).dtype))
        model.backward(out.float().pow(2).sum() / out[0].numel() / 4, last_micro_batch=True)
        model.step()


def full_state(model) -> dict:
    """Every trainable parameter's whole fp32 master and moments, the Adam step and the learning rate."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from rlhf.engines.portable_state import _stepped

    wrapped = hasattr(model.engine.optimizer, "optimizer")
    out = {}
    for name, p in model.module.named_parameters():
        if not p.requires_grad:  # a LoRA base
            continue
        for key in (None, "exp_avg", "exp_avg_sq"):
            if wrapped:
                value = safe_get_full_fp32_param(p) if key is None else safe_get_full_optimizer_state(p, key)
            else:
                value = p.detach() if key is None else model.engine.optimizer.state[p][key]
            out[f"{name}:{key or 'fp32'}"] = value.detach().clone().reshape(-1)
    inner, stepped = _stepped(model.engine, model.zero_stage)
    out["step"] = {float(inner.state[t]["step"]) for tensors in stepped for t in tensors}
    out["lr"] = model.learning_rate()
    return out


def model_for(zero_stage: int, lora: bool):
    from tests.tiny_lora import lora_model

    return lora_model("actor", zero_stage, lr=1e-2) if lora else tiny_model(zero_stage)


def save_after_two_steps(zero_stage: int, directory: str, lora: bool = False) -> dict:
    model = model_for(zero_stage, lora)
    train_steps(model, 2)
    model.save_state(directory)
    saved = full_state(model)
    train_steps(model, 1, first=2)
    return {"saved": saved, "next": full_state(model)}


def load(zero_stage: int, directory: str, universal: bool, lora: bool = False) -> dict:
    model = model_for(zero_stage, lora)
    line = model.load_state(directory, universal=universal)
    loaded = full_state(model)
    train_steps(model, 1, first=2)
    return {"line": line, "loaded": loaded, "next": full_state(model)}


def refusal(zero_stage: int, directory: str, bf16: bool, ema: float | None) -> str:
    from rlhf.config.errors import UsageError

    model = tiny_model(zero_stage, bf16=bf16, ema=ema)
    try:
        model.load_state(directory)
    except UsageError as err:
        return str(err)
    return "loaded"


def assert_next_step_close(want: dict, got: dict, what: str) -> None:
    """The step after a move against the unmoved run's next step: both start from the same state, bit for bit, and
    their gradients differ by float32 rounding (2 ranks' halves all-reduced against 1 rank's whole batch). The
    weights agree by AdamW's bound (lr 1e-2, one step: a near-zero gradient's move follows its rounding; measured
    6.6e-7 on a LoRA A weight whose exp_avg was 3e-8); the moments carry the gradient's rounding, (1-β1)·δg and
    (1-β2)·2g·δg, so they agree within 1e-5 of each tensor's largest moment (measured 6.5e-7 at most)."""
    from tests.tiny_runs import assert_adam_weights_close

    weights = {key: value for key, value in want.items() if key.endswith(":fp32")}
    assert_adam_weights_close(weights, got, lr=1e-2, steps=1, what=what)
    for key, value in want.items():
        if torch.is_tensor(value) and not key.endswith(":fp32"):
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-5 * float(value.abs().max()),
                                       msg=lambda m, key=key: f"{what} {key}: {m}")


def test_states_move_between_stages_and_world_sizes_exactly(tmp_path):
    dirs = {stage: str(tmp_path / f"zero{stage}") for stage in SAVED}
    saves = run_variants_on_ranks(2, [(save_after_two_steps, stage, dirs[stage]) for stage in SAVED])
    saved = {stage: result[0] for stage, result in zip(SAVED, saves)}
    os.remove(os.path.join(dirs[2], "layout.json"))  # as written before layouts were recorded: DeepSpeed's file says
    same = run_variants_on_ranks(2, [(load, stage, dirs[stage], True) for stage in SAVED])
    moved = run_variants_on_ranks(1, [(load, to, dirs[frm], False) for frm in SAVED for to in LOADED])
    pairs = [((frm, 2), (frm, 2), r[0]) for frm, r in zip(SAVED, same)]
    pairs += [((frm, 2), (to, 1), r[0]) for (frm, to), r in zip([(f, t) for f in SAVED for t in LOADED], moved)]
    for (frm, _), (to, dp), result in pairs:
        what = f"ZeRO-{frm} x2 -> ZeRO-{to} x{dp}"
        ranks = f"{dp} rank{'s' if dp > 1 else ''}"
        line = (f"the model's state moved from ZeRO-{frm} over 2 ranks to ZeRO-{to} over {ranks} (through "
                f"{dirs[frm]}/universal)")
        assert result["line"] == (None if frm == to == 0 and dp == 1 else line), what  # stage 0 states are whole
        for key, want in saved[frm]["saved"].items():
            got = result["loaded"][key]
            assert (got == want) if not torch.is_tensor(want) else torch.equal(got, want), (what, key)
        assert_next_step_close(saved[frm]["next"], result["next"], what)
        assert result["next"]["step"] == {3.0} and result["next"]["lr"] == saved[frm]["next"]["lr"], what
    assert os.path.isfile(os.path.join(dirs[0], "universal", "state", "zero", "0.weight", "exp_avg.pt"))
    lora_moves = {2: 3, 3: 0}  # LoRA adapters (the frozen base is --pretrain's, not in the state) both ways
    lora_dirs = {frm: str(tmp_path / f"lora{frm}") for frm in lora_moves}
    lora_saved = run_variants_on_ranks(2, [(save_after_two_steps, frm, lora_dirs[frm], True) for frm in lora_moves])
    lora_loaded = run_variants_on_ranks(1, [(load, to, lora_dirs[frm], False, True) for frm, to in lora_moves.items()])
    for (frm, to), saved_lora, loaded in zip(lora_moves.items(), lora_saved, lora_loaded):
        want, got = saved_lora[0], loaded[0]
        assert got["line"].startswith(f"the actor's state moved from ZeRO-{frm} over 2 ranks to ZeRO-{to} over 1")
        assert any(".lora_B." in key for key in want["saved"])
        for key, value in want["saved"].items():
            assert (got["loaded"][key] == value) if not torch.is_tensor(value) else \
                torch.equal(got["loaded"][key], value), (frm, to, key)
        assert_next_step_close(want["next"], got["next"], f"lora ZeRO-{frm} x2 -> ZeRO-{to} x1")
    refusals = run_variants_on_ranks(1, [(refusal, 3, dirs[2], False, 0.99), (refusal, 3, dirs[0], True, None)])
    assert refusals[0][0] == (f"{dirs[2]}: the model's --enable_ema averages were saved by ZeRO-2 over 2 ranks and "
                              "cannot move to ZeRO-3 over 1 rank: resume with that layout, or start a new --ckpt_path")
    assert refusals[1][0].startswith(f"{dirs[0]}: the model's state cannot move between --zero_stage 0 and "
                                     "--zero_stage 3 in bf16")


def tensor_parallel_model(tp: int, zero_stage: int = 2):
    """The tiny Llama in fp32 on 2 ranks: with `tp` 2 its linear layers split over both (DeepSpeed AutoTP, one
    data-parallel replica), with 1 data-parallel over both."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from rlhf.assets import TINY_DIR
    from rlhf.config.shared_config import EngineConfig, OptimConfig
    from rlhf.engines.deepspeed_engine import DeepSpeedModel, GroupMPU

    own = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
    data = own if tp == 2 else dist.group.WORLD
    tp_group = dist.group.WORLD if tp == 2 else None
    build = lambda: AutoModelForCausalLM.from_pretrained(f"{TINY_DIR}/policy", torch_dtype=torch.float32)  # noqa: E731
    return DeepSpeedModel(build, EngineConfig(zero_stage=zero_stage, ds_tensor_parallel_size=tp), OptimConfig(),
                          learning_rate=1e-2, bf16=False, micro_batch_size=2, grad_accum_steps=1, num_optimizer_steps=4,
                          device=torch.device("cpu"), dp_group=data,
                          mpu=GroupMPU(data, tp_group) if tp_group is not None else None, tp_group=tp_group)


def tensor_parallel_steps(model, steps: int, first: int = 0) -> None:
    """The same 2 sequences on both ranks of a tensor-parallel group."""
    for step in range(first, first + steps):
        ids = torch.randint(4, 64, (2, 12), generator=torch.Generator().manual_seed(step))
        model.backward(model.engine(input_ids=ids, labels=ids).loss, last_micro_batch=True)
        model.step()


def tensor_parallel_save(directory: str, tp: int = 2, zero_stage: int = 2) -> dict:
    model = tensor_parallel_model(tp, zero_stage)
    tensor_parallel_steps(model, 2)
    model.save_state(directory)
    saved = dict(model.full_parameters())
    tensor_parallel_steps(model, 1, first=2)
    return {"saved": saved, "next": dict(model.full_parameters())}


def tensor_parallel_load(directory: str, tp: int) -> dict:
    model = tensor_parallel_model(tp)
    line = model.load_state(directory)
    loaded = dict(model.full_parameters())
    tensor_parallel_steps(model, 1, first=2)
    return {"line": line, "loaded": loaded, "next": dict(model.full_parameters())}


def test_a_tensor_parallel_state_resumes_exactly_and_moves_to_another_tensor_parallel_size(tmp_path):
    """--ds_tensor_parallel_size 2: the gathered weights after a save and a load at the same layout, and after the
    next step, equal the run that never stopped bit for bit. A TP-2 state loaded data-parallel (TP-1 over the same 2
    ranks), a data-parallel state loaded at TP-2, and a TP-2 state of ZeRO-0 (each tensor-parallel rank's slices and
    moments in its own model file) loaded data-parallel at ZeRO-2, move through the universal form (the slices merged
    whole, each rank of the new layout takes its own): the loaded weights equal the saved ones bit for bit, and
    the next step (Adam's moments moved too, or it would differ by about the learning rate) the unmoved run's next
    step within AdamW's rounding bound."""
    import json

    from tests.tiny_runs import assert_adam_weights_close

    tp2, tp1, tp2_zero0 = str(tmp_path / "tp2"), str(tmp_path / "tp1"), str(tmp_path / "tp2_zero0")
    save2, save1, save0, same, to_tp1, to_tp2, from_zero0 = run_variants_on_ranks(2, [
        (tensor_parallel_save, tp2), (tensor_parallel_save, tp1, 1), (tensor_parallel_save, tp2_zero0, 2, 0),
        (tensor_parallel_load, tp2, 2), (tensor_parallel_load, tp2, 1), (tensor_parallel_load, tp1, 2),
        (tensor_parallel_load, tp2_zero0, 1)])
    with open(os.path.join(tp2, "layout.json")) as f:
        assert json.load(f) == {"zero_stage": 2, "dp_size": 1, "tp_size": 2, "dtype": "fp32"}
    assert save2[0]["saved"]["model.layers.0.mlp.gate_proj.weight"].shape == (256, 64)  # gathered whole (128 rows each)
    for rank in (0, 1):
        assert same[rank]["line"] is None
        for key in ("saved", "next"):
            want, got = save2[rank][key], same[rank]["loaded" if key == "saved" else "next"]
            assert want.keys() == got.keys()
            for name, value in want.items():
                assert torch.equal(got[name], value), (rank, key, name)
    moves = ((save2, to_tp1, tp2, "ZeRO-2 over 1 x 2 ranks (data x tensor parallel)", "ZeRO-2 over 2 ranks"),
             (save1, to_tp2, tp1, "ZeRO-2 over 2 ranks", "ZeRO-2 over 1 x 2 ranks (data x tensor parallel)"),
             (save0, from_zero0, tp2_zero0, "ZeRO-0 over 1 x 2 ranks (data x tensor parallel)", "ZeRO-2 over 2 ranks"))
    for saved, moved, directory, was, now in moves:
        for rank in (0, 1):
            assert moved[rank]["line"] == (f"the model's state moved from {was} to {now} (through "
                                           f"{directory}/universal)")
            assert saved[rank]["saved"].keys() == moved[rank]["loaded"].keys()
            for name, value in saved[rank]["saved"].items():
                assert torch.equal(moved[rank]["loaded"][name], value), (was, now, rank, name)
            assert_adam_weights_close(saved[rank]["next"], moved[rank]["next"], lr=1e-2, steps=1,
                                      what=f"{was} -> {now}, the next step")
