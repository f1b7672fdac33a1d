"""A tiny multi-turn environment for `--agent_func_path`: answer with the row's digit (its label).

A prompt either shows the digit (the copy task's prompts, `... copy D :`) or hides it (guess_prompts.jsonl
pairs each prompt with every digit, so a first guess there is right one time in ten at best). A wrong first
answer (its first word) is answered with a hint, " copy D :", and the model answers again. The turn that ends
the episode (a right answer, or the last one) is rewarded with the fraction of its first four words that are
the digit (the embedded demo's copy reward); earlier turns get 0. The embedded tiny policy starts out unable to
copy: with both kinds of prompts (launch/examples/agent_tiny_cpu.sh) the first answer learns to copy a shown
digit and the second to use the hint, so the reward rises well above `reward_extra/first_guess_right`.
"""

GUESSES = 2


def step(observation, action, label, **kwargs):
    words = action.replace("</s>", " ").split()
    right = bool(words) and words[0] == str(label)
    turn = kwargs.get("turn", 0)
    done = right or turn + 1 >= GUESSES
    return {
        "rewards": sum(w == str(label) for w in words[:4]) / 4.0 if done else 0.0,
        "scores": float(right),
        "done": done,
        "environment_feedback": "" if done else f" copy {label} :",
        "extra_logs": {"first_guess_right": float(right and turn == 0)},
    }
