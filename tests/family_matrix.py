"""The README's model-family compatibility table, derived from the tests that prove each cell: every row names a
test and takes its families from that test's own parameter list, so a family dropped from a test drops its mark.

    PYTHONPATH=. python tests/family_matrix.py      prints the table (paste it between the README's markers)
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhf.models.zoo import FAMILIES, family

BEGIN, END = "<!-- family table: begin -->", "<!-- family table: end -->"


@dataclass(frozen=True)
class Row:
    path: str
    test: str  # file::function
    families: tuple[str, ...]
    only: str | None = None  # "moe": the path exists for mixture-of-experts families only


def rows() -> list[Row]:
    from tests.dist import test_kernels_ring_attention as ring
    from tests.dist import test_zero3_families as zero3
    from tests.e2e import test_model_families_vllm as engines
    from tests.unit import test_model_families as unit

    u = "tests/unit/test_model_families.py::"
    return [
        Row("tokenizer: bos / eos / pad, rollout stop ids, BOS once",
            u + "test_tokenizer_special_tokens_follow_the_family",
            tuple(unit.NAMES)),
        Row("packed == padded: log-probs, entropy, gradients", u + "test_packed_equals_padded_logprobs_entropy_and_"
            "gradients", tuple(unit.NAMES)),
        Row("multi-turn chat SFT, loss on assistant tokens only", u + "test_multiturn_chat_sft_targets_only_"
            "assistant_tokens", tuple(unit.NAMES)),
        Row("LoRA train step + merge == adapted model", u + "test_lora_train_step_and_merge_equal_the_adapted_model",
            tuple(unit.NAMES)),
        Row("reward model: packed == padded scores", u + "test_packed_reward_scores_equal_padded",
            tuple(unit.RM_FAMILIES)),
        Row("HF export reloads; push stream == checkpoint tensors", u + "test_hf_export_reloads_and_the_weight_stream_"
            "has_checkpoint_names", tuple(unit.EXPORT_FAMILIES)),
        Row("router loss (`--aux_loss_coef`), packed == padded", u + "test_router_aux_loss_is_returned_and_packed_"
            "equals_padded", tuple(unit.MOE_FAMILIES), only="moe"),
        Row("ring attention (2 ranks) == unsharded", "tests/dist/test_kernels_ring_attention.py::test_ring_llama_"
            "equals_unsharded_varlen_llama", tuple(f for f in ring.RING_FAMILIES if f)),
        Row("ZeRO-3 (2 ranks, MoE blocks as leaf modules) step == plain step", "tests/dist/test_zero3_families.py::"
            "test_zero3_step_equals_the_plain_step_on_every_family", tuple(zero3.ZERO3_FAMILIES)),
        Row("vLLM log-probs == actor after a push; stops on the chat eos", "tests/e2e/test_model_families_vllm.py::"
            "test_engine_logprobs_match_actor_after_push_per_family", tuple(engines.FAMILIES)),
        Row("GRPO, 2 ranks, ZeRO-3, packed, vLLM", "tests/e2e/test_model_families_vllm.py::test_grpo_on_mixtral_"
            "zero3_packed_keeps_engine_and_actor_in_step", ("mixtral",)),
    ]


def cell(row: Row, name: str) -> str:
    if row.only == "moe" and not family(name).moe:
        return "n/a"
    return "✓" if name in row.families else "–"


def table() -> str:
    names = list(FAMILIES)
    lines = [f"| path (test) | {' | '.join(names)} |", "|---|" + "---|" * len(names)]
    for row in rows():
        lines.append(f"| {row.path} (`{row.test.split('::')[1]}`) | {' | '.join(cell(row, n) for n in names)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
