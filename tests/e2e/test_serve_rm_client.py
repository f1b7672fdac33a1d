"""The reward server (serve_rm, a separate process) and its client give the local reward model's scores."""

import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from rlhf.assets import TINY_DIR
from rlhf.models.loading import load_tokenizer
from rlhf.models.micro_batches import MicroBatcher
from rlhf.models.value import load_scalar_head_model
from rlhf.rewards import RemoteRewardClient, RewardInputs, RewardModelEnsemble
from tests.distributed import ROOT, free_port

QUERIES = ["copy 3 : 3 3 3 3", "a copy 5 : 1 2 3 4", "copy 7 : 7 b 7 c"]


def batch(tok):
    enc = tok(QUERIES, padding=True, return_tensors="pt", add_special_tokens=False)
    return RewardInputs(QUERIES, [""] * 3, [None] * 3, enc["input_ids"], enc["attention_mask"])


@pytest.fixture
def rm_server():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "rlhf.cli.serve_rm", "--reward_pretrain",
                             f"{TINY_DIR}/reward_model", "--port", str(port), "--param_dtype", "fp32",
                             "--attn_implementation", "sdpa"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}/get_reward"
    deadline = time.time() + 120
    while True:
        try:
            urllib.request.urlopen(urllib.request.Request(url, data=b'{"query": []}'), timeout=1)
            break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                raise RuntimeError(f"serve_rm did not start: {proc.stdout.read()}") from None
            time.sleep(0.5)
    yield url
    proc.terminate()
    proc.wait(timeout=30)


def test_remote_server_matches_local_reward_model(rm_server):
    tok = load_tokenizer(f"{TINY_DIR}/reward_model")
    model = load_scalar_head_model(f"{TINY_DIR}/reward_model", "score", torch.float32, "sdpa").eval()
    local = RewardModelEnsemble([model], torch.device("cpu"), MicroBatcher(4)).score(batch(tok))
    remote = RemoteRewardClient(rm_server, timeout_s=10, retries=2).score(batch(tok))
    torch.testing.assert_close(remote.rewards_B, local.rewards_B, atol=1e-5, rtol=1e-5)
