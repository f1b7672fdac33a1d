"""--dynamic_filtering's refill prompts are seeded by step and round."""


from rlhf.data.prompts import Prompt, PromptSampler


def test_refill_prompts_are_seeded_by_step_and_round():
    prompts = [Prompt(str(i), (i,), None) for i in range(10)]
    sampler = PromptSampler(prompts, 4, seed=3)
    a, b = sampler.refill(5, 1, 4), sampler.refill(5, 1, 4)
    assert a == b and len({p.text for p in a}) == 4  # without replacement, reproducible
    assert sampler.refill(5, 2, 4) != a and sampler.refill(6, 1, 4) != a
    assert len(sampler.refill(0, 1, 25)) == 25  # more than the dataset: with replacement
