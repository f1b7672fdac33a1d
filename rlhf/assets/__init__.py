"""Files that ship with the package: the embedded tiny demo (tokenizer, policy, prompts, reward) and
the copy-task data of the supervised jobs (SFT, reward-model pairs, process-reward steps).

`python -m rlhf.cli.build_tiny` regenerates everything under `tiny/` deterministically;
`python -m rlhf.cli.build_tiny --data_only` rewrites only the supervised data files. Their format and
the PRM token choices are described in `build_tiny`'s docstring.
"""

from pathlib import Path

TINY_DIR = Path(__file__).resolve().parent / "tiny"
TOY_DIR = Path(__file__).resolve().parent / "toy"
EMBEDDED_MODEL_DIR = str(TINY_DIR / "policy")
EMBEDDED_PROMPTS = str(TINY_DIR / "prompts.jsonl")
EMBEDDED_REWARD = str(TINY_DIR / "reward.py")
EMBEDDED_REWARD_MODEL_DIR = str(TINY_DIR / "reward_model")

# supervised data of the copy task (train / eval files)
EMBEDDED_SFT = str(TINY_DIR / "sft.jsonl")
EMBEDDED_SFT_EVAL = str(TINY_DIR / "sft_eval.jsonl")
EMBEDDED_PAIRS = str(TINY_DIR / "pairs.jsonl")
EMBEDDED_PAIRS_EVAL = str(TINY_DIR / "pairs_eval.jsonl")
EMBEDDED_PRM = str(TINY_DIR / "prm.jsonl")
EMBEDDED_PRM_EVAL = str(TINY_DIR / "prm_eval.jsonl")
# unused words of the 64-token vocabulary: the step placeholder and the (good, bad) reward tokens
EMBEDDED_PRM_PLACEHOLDER = "w0"
EMBEDDED_PRM_REWARD_TOKENS = ("w1", "w2")

# the RePULSe toy (one prompt, 2-word responses, bad words x y z) on the embedded tiny policy
TOY_REWARD = str(TOY_DIR / "reward.py")
TOY_PROMPTS = str(TOY_DIR / "prompts.jsonl")  # the one prompt, under the key "prompt" (the fork's dataset's)
TOY_PROMPT = "copy :"
TOY_BAD_WORDS = "x y z"
