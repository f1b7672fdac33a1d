"""A tiny multi-turn environment for `--agent_func_path`: guess the hidden digit (the row's label).

The prompt does not show the digit (guess_prompts.jsonl pairs each prompt with every digit), so the
first guess (the first word of the model's turn) is right one time in ten at best. A wrong first guess
is answered with a hint, " copy D :", and the model guesses again. The turn that ends the episode (a
right guess, or the last one) is rewarded with the fraction of its first four words that are the digit
(the embedded demo's copy reward); earlier turns get 0. The embedded tiny policy starts out unable to
copy, so the reward rises as it learns to use the hint.
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
