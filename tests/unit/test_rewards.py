"""Reward sources behind one interface: reward models (summed, packed == padded, saved as sequence classifiers), the
HTTP client (retries, clear errors) and reward_func extra logs."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from rlhf.assets import TINY_DIR
from rlhf.models.layout import SequenceLayout
from rlhf.models.loading import load_tokenizer
from rlhf.models.micro_batches import MicroBatcher
from rlhf.models.value import last_token_values, load_scalar_head_model
from rlhf.rewards import RemoteRewardClient, RewardInputs, RewardModelEnsemble
from tests.distributed import free_port

QUERIES = ["copy 3 : 3 3 3 3", "a copy 5 : 1 2 3 4", "copy 7 : 7 b 7 c"]


def batch(tok):
    enc = tok(QUERIES, padding=True, return_tensors="pt", add_special_tokens=False)
    return RewardInputs(QUERIES, [""] * 3, [None] * 3, enc["input_ids"], enc["attention_mask"])


def test_reward_model_scores_the_copy_task_and_ensembles_sum():
    tok = load_tokenizer(f"{TINY_DIR}/reward_model")
    model = load_scalar_head_model(f"{TINY_DIR}/reward_model", "score", torch.float32, "sdpa").eval()
    one = RewardModelEnsemble([model], torch.device("cpu"), MicroBatcher(2)).score(batch(tok))
    # the shipped reward model learned the rule reward: 1.0, 0.0, 0.5
    torch.testing.assert_close(one.rewards_B, torch.tensor([1.0, 0.0, 0.5]), atol=0.15, rtol=0)
    two = RewardModelEnsemble([model, model], torch.device("cpu"), MicroBatcher(3)).score(batch(tok))
    torch.testing.assert_close(two.rewards_B, 2 * one.rewards_B)
    torch.testing.assert_close(two.extra_logs["rm1"], one.rewards_B)


def test_packed_reward_scores_match_padded():
    tok = load_tokenizer(f"{TINY_DIR}/reward_model")
    padded_model = load_scalar_head_model(f"{TINY_DIR}/reward_model", "score", torch.float32, "sdpa").eval()
    packed_layout = SequenceLayout(packing=True)
    packed_model = load_scalar_head_model(f"{TINY_DIR}/reward_model", "score", torch.float32,
                                          packed_layout.attn_implementation("sdpa")).eval()
    padded = RewardModelEnsemble([padded_model], torch.device("cpu"), MicroBatcher(3)).score(batch(tok))
    # dynamic batching: a 15-token budget packs the three queries (7, 8, 7 tokens) into two forwards
    packed = RewardModelEnsemble([packed_model], torch.device("cpu"),
                                 MicroBatcher(3, max_tokens=15, layout=packed_layout)).score(batch(tok))
    torch.testing.assert_close(packed.rewards_B, padded.rewards_B, atol=1e-5, rtol=1e-5)


def test_saved_reward_model_loads_as_sequence_classification():
    from transformers import AutoModelForSequenceClassification

    tok = load_tokenizer(f"{TINY_DIR}/reward_model")
    hf = AutoModelForSequenceClassification.from_pretrained(f"{TINY_DIR}/reward_model", num_labels=1)
    ours = load_scalar_head_model(f"{TINY_DIR}/reward_model", "score", torch.float32, "sdpa")
    b = batch(tok)
    with torch.no_grad():
        expected = last_token_values(ours(b.sequences_BT, b.attention_mask_BT), b.attention_mask_BT)
        got = hf(input_ids=b.sequences_BT, attention_mask=b.attention_mask_BT).logits.squeeze(-1)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


class _Flaky(BaseHTTPRequestHandler):
    calls = 0

    def do_POST(self):  # noqa: N802
        _Flaky.calls += 1
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if _Flaky.calls == 1:
            self.send_response(503)
            self.end_headers()
            return
        data = json.dumps({"rewards": [float(len(q)) for q in body["query"]]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        return


def test_client_retries_server_errors_then_succeeds():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        inputs = RewardInputs(["ab", "abcd"], ["", ""], [None, None], torch.zeros(2, 1), torch.ones(2, 1))
        out = RemoteRewardClient(url, timeout_s=5, retries=3, backoff_s=0.01).score(inputs)
        torch.testing.assert_close(out.rewards_B, torch.tensor([2.0, 4.0]))
        assert _Flaky.calls == 2
    finally:
        server.shutdown()


def test_client_gives_up_with_a_clear_error():
    url = f"http://127.0.0.1:{free_port()}/get_reward"  # nothing listens there
    inputs = RewardInputs(["a"], [""], [None], torch.zeros(1, 1), torch.ones(1, 1))
    with pytest.raises(RuntimeError, match=r"failed 2 times \(timeout 1.0s\)"):
        RemoteRewardClient(url, timeout_s=1.0, retries=2, backoff_s=0.01).score(inputs)


def test_reward_func_extra_logs_may_hold_one_value_per_batch():
    """OpenRLHF's reward functions often log `reward.mean().item()`: a batch value stands for each query."""
    from rlhf.rewards.base import result_from_output

    out = result_from_output({"rewards": [1.0, 0.0, 0.5], "extra_logs": {"batch_mean": 0.5,
                                                                        "as_tensor": torch.tensor(2.0),
                                                                        "per_query": [1, 2, 3]}}, 3, "reward_func")
    torch.testing.assert_close(out.extra_logs["batch_mean"], torch.full((3,), 0.5))
    torch.testing.assert_close(out.extra_logs["as_tensor"], torch.full((3,), 2.0))
    torch.testing.assert_close(out.extra_logs["per_query"], torch.tensor([1.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match=r"returned 2 extra_logs\['bad'\] for 3 queries"):
        result_from_output({"rewards": [1.0, 0.0, 0.5], "extra_logs": {"bad": [1, 2]}}, 3, "reward_func")
