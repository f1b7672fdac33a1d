"""Files that ship with the package: the embedded tiny demo (tokenizer, policy, prompts, reward).

`python -m rlhf.assets.build_tiny` regenerates everything under `tiny/` deterministically.
"""

from pathlib import Path

TINY_DIR = Path(__file__).resolve().parent / "tiny"
EMBEDDED_MODEL_DIR = str(TINY_DIR / "policy")
EMBEDDED_PROMPTS = str(TINY_DIR / "prompts.jsonl")
EMBEDDED_REWARD = str(TINY_DIR / "reward.py")
EMBEDDED_REWARD_MODEL_DIR = str(TINY_DIR / "reward_model")
