"""Token-budget micro-batching ("dynamic batch size"): which samples go into which micro-batch on which
data-parallel rank. Pure functions over sample lengths; they return index lists and never touch
tensors, process groups or models.

Every data-parallel rank must run the SAME number of micro-batches, because each micro-batch's
forward/backward is collective (ZeRO-3 gathers, gradient all-reduce). We get that by
redistribution, not by padding: every rank packs its samples first-fit-decreasing under the budget,
the largest count k over ranks is taken, and ranks with fewer bins split their fullest bins until they
also have k (a split never exceeds the budget). Only a rank holding fewer than k samples gets empty
micro-batches appended; the caller must still run those steps (e.g. a forward on a dummy token with
zero loss weight) to keep collectives matched.

Loss normalisation is the caller's: sum per-token losses in each micro-batch and divide by the global
token count across micro-batches and ranks, so the result equals the unsplit token-mean.
"""

from __future__ import annotations

from collections.abc import Sequence


def _check_budget(lengths: Sequence[int], max_tokens_per_micro_batch: int) -> None:
    if max_tokens_per_micro_batch <= 0:
        raise ValueError(f"max_tokens_per_micro_batch must be positive, got {max_tokens_per_micro_batch}")
    too_long = [(i, n) for i, n in enumerate(lengths) if n > max_tokens_per_micro_batch]
    if too_long:
        i, n = too_long[0]
        raise ValueError(f"sample {i} has {n} tokens, more than max_tokens_per_micro_batch="
                         f"{max_tokens_per_micro_batch}; raise the budget above the longest sample")


def first_fit_decreasing(lengths: Sequence[int], max_tokens_per_micro_batch: int) -> list[list[int]]:
    """Bins of sample indices, each summing to at most the budget; longest samples are placed first."""
    _check_budget(lengths, max_tokens_per_micro_batch)
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        target = next((b for b, load in enumerate(loads) if load + lengths[i] <= max_tokens_per_micro_batch), None)
        if target is None:
            bins.append([])
            loads.append(0)
            target = len(bins) - 1
        bins[target].append(i)
        loads[target] += lengths[i]
    return bins


def count_micro_batches(lengths: Sequence[int], max_tokens_per_micro_batch: int) -> int:
    """How many micro-batches this rank needs on its own; all-reduce MAX it over the DP group and pass the
    result to `split_into_micro_batches` so every rank runs the same count."""
    return len(first_fit_decreasing(lengths, max_tokens_per_micro_batch))


def _split_in_two(indices: list[int], lengths: Sequence[int]) -> tuple[list[int], list[int]]:
    halves: tuple[list[int], list[int]] = ([], [])
    loads = [0, 0]
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        side = 0 if loads[0] <= loads[1] else 1
        halves[side].append(i)
        loads[side] += lengths[i]
    return halves


def split_into_micro_batches(lengths: Sequence[int], max_tokens_per_micro_batch: int,
                             num_micro_batches: int | None = None) -> list[list[int]]:
    """Sample indices per micro-batch, every micro-batch within the token budget.

    With `num_micro_batches` (>= what the budget needs), exactly that many are returned: the fullest
    splittable bins are split in two; if there are fewer samples than micro-batches, empty ones are
    appended at the end. Non-empty micro-batches come in the order of their first sample index.
    """
    bins = first_fit_decreasing(lengths, max_tokens_per_micro_batch)
    if num_micro_batches is None:
        return _in_data_order(bins)
    if num_micro_batches < len(bins):
        raise ValueError(f"num_micro_batches={num_micro_batches} is fewer than the {len(bins)} micro-batches that "
                         f"max_tokens_per_micro_batch={max_tokens_per_micro_batch} needs")
    while len(bins) < num_micro_batches:
        splittable = [b for b in bins if len(b) >= 2]
        if not splittable:
            break
        fullest = max(splittable, key=lambda b: sum(lengths[i] for i in b))
        bins.remove(fullest)
        bins.extend(_split_in_two(fullest, lengths))
    bins = _in_data_order(bins)
    return bins + [[] for _ in range(num_micro_batches - len(bins))]


def _in_data_order(bins: list[list[int]]) -> list[list[int]]:
    """Sorted indices inside each micro-batch, micro-batches ordered by their first index."""
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


def partition_across_ranks(lengths: Sequence[int], dp_size: int) -> list[list[int]]:
    """Global sample indices per DP rank, balancing token counts (longest-processing-time greedy).

    Ranks may receive different numbers of samples; their token totals differ by at most one sample.
    """
    if dp_size <= 0:
        raise ValueError(f"dp_size must be positive, got {dp_size}")
    if len(lengths) < dp_size:
        raise ValueError(f"{len(lengths)} samples cannot feed {dp_size} data-parallel ranks; "
                         "use a larger rollout batch or fewer ranks")
    ranks: list[list[int]] = [[] for _ in range(dp_size)]
    loads = [0] * dp_size
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(dp_size), key=lambda r: (loads[r], len(ranks[r]), r))
        ranks[r].append(i)
        loads[r] += lengths[i]
    return [sorted(r) for r in ranks]


def balanced_micro_batches(lengths_per_rank: Sequence[Sequence[int]],
                           max_tokens_per_micro_batch: int) -> list[list[list[int]]]:
    """[rank][micro-batch] -> that rank's LOCAL sample indices; every rank gets the same micro-batch count."""
    k = max(count_micro_batches(lengths, max_tokens_per_micro_batch) for lengths in lengths_per_rank)
    return [split_into_micro_batches(lengths, max_tokens_per_micro_batch, k) for lengths in lengths_per_rank]


def dynamic_micro_batches(lengths: Sequence[int], dp_size: int,
                          max_tokens_per_micro_batch: int) -> list[list[list[int]]]:
    """[rank][micro-batch] -> GLOBAL sample indices: token-balanced over ranks, then budgeted micro-batches."""
    _check_budget(lengths, max_tokens_per_micro_batch)
    per_rank = partition_across_ranks(lengths, dp_size)
    local = balanced_micro_batches([[lengths[i] for i in idx] for idx in per_rank], max_tokens_per_micro_batch)
    return [[[idx[j] for j in mb] for mb in rank_mbs] for idx, rank_mbs in zip(per_rank, local)]
