"""serve_rm's failure answers and limits (500 with the message, 400/413/401, read timeout, bounded
threads) and the HTTP client's retries, token and error messages. Servers run in-process in a thread."""

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from rlhf.cli.serve_rm import RewardServer
from rlhf.rewards import RemoteRewardClient, RewardInputs
from rlhf.rewards.base import RewardResult
from rlhf.rewards.remote import API_KEY_ENV
from tests.distributed import free_port

INPUTS = RewardInputs(["ab", "abcd"], ["", ""], [None, None], torch.zeros(2, 1), torch.ones(2, 1))


class LengthReward:
    """Reward = number of characters in the query."""

    def score(self, batch: RewardInputs) -> RewardResult:
        rewards = torch.tensor([float(len(q)) for q in batch.queries])
        return RewardResult(rewards, rewards.clone())


class Raises:
    def __init__(self, err: Exception) -> None:
        self.err = err

    def score(self, batch: RewardInputs) -> RewardResult:
        raise self.err


@contextmanager
def serving(server):
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/get_reward"
    finally:
        server.shutdown()
        server.server_close()


def reward_server(source=None, **limits) -> RewardServer:
    return RewardServer(("127.0.0.1", 0), source or LengthReward(), None, **limits)


def post(url: str, body: bytes, headers: dict | None = None, timeout: float = 10.0) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


GOOD = json.dumps({"query": ["ab", "abcd"]}).encode()


def stalled_upload(url: str) -> socket.socket:
    """A client that sends headers promising 1000 bytes, one byte of body, then nothing."""
    port = int(url.split(":")[2].split("/")[0])
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
    return sock


def read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_any_scoring_error_is_a_500_with_the_message(capsys):
    with serving(reward_server(Raises(KeyError("no_such_column")))) as url:
        code, body = post(url, GOOD)
        assert code == 500
        assert "KeyError" in body["error"] and "no_such_column" in body["error"]
        # the client retries 500s and then names the server and its message
        with pytest.raises(RuntimeError, match=rf"reward server {url} failed 2 times.*HTTP 500.*no_such_column"):
            RemoteRewardClient(url, timeout_s=5, retries=2, backoff_s=0.01).score(INPUTS)
    assert "no_such_column" in capsys.readouterr().err  # the traceback is logged server-side


def test_value_error_from_the_source_is_a_422_that_the_client_does_not_retry():
    with serving(reward_server(Raises(ValueError("labels must be digits")))) as url:
        assert post(url, GOOD) == (422, {"error": "labels must be digits"})
        started = time.monotonic()
        with pytest.raises(ValueError, match=rf"reward server {url} answered HTTP 422: labels must be digits"):
            RemoteRewardClient(url, timeout_s=5, retries=3, backoff_s=5.0).score(INPUTS)
        assert time.monotonic() - started < 4  # no backoff sleep: not retried


@pytest.mark.parametrize("body, expected", [
    (b"{not json", "body is not JSON"),
    (b"[1, 2]", "expected a JSON object with 'query', got list"),
    (b'{"prompts": ["a"]}', "'query' must be a list of strings (got no query)"),
    (b'{"query": [1, 2]}', "'query' must be a list of strings"),
    (b'{"query": ["a", "b"], "prompts": ["x"]}', "'prompts' must be a list of 2 strings"),
    (b'{"query": ["a", "b"], "labels": [1, 2, 3]}', "'labels' must be a list of 2 values"),
])
def test_malformed_requests_are_400s_naming_the_problem(body, expected):
    with serving(reward_server()) as url:
        code, answer = post(url, body)
        assert code == 400 and expected in answer["error"]
        assert post(url, GOOD) == (200, {"rewards": [2.0, 4.0], "scores": [2.0, 4.0], "extra_logs": {}})


@pytest.mark.parametrize("size", [20_000, 4_000_000])  # the larger one overflows the socket buffers
def test_oversize_body_is_a_413(size):
    with serving(reward_server(max_request_mb=0.01)) as url:
        body = json.dumps({"query": ["x" * size]}).encode()
        code, answer = post(url, body)
        assert code == 413 and "--max_request_mb" in answer["error"] and str(len(body)) in answer["error"]
        with pytest.raises(ValueError, match=rf"reward server {url} answered HTTP 413"):
            RemoteRewardClient(url, timeout_s=5, retries=3, backoff_s=5.0).score(
                RewardInputs(["x" * size], [""], [None], torch.zeros(1, 1), torch.ones(1, 1)))
        assert post(url, GOOD)[0] == 200


def test_stalled_upload_is_dropped_after_the_timeout():
    with serving(reward_server(request_timeout_s=0.5)) as url:
        body_stall = stalled_upload(url)
        port = int(url.split(":")[2].split("/")[0])
        header_stall = socket.create_connection(("127.0.0.1", port), timeout=10)
        header_stall.sendall(b"POST /get_reward HTTP/1.1\r\nContent-Le")
        started = time.monotonic()
        answer = read_all(body_stall)  # the server answers 408 and closes
        assert answer.startswith(b"HTTP/1.0 408") and b"--request_timeout 0.5s" in answer
        assert read_all(header_stall) == b""  # closed without an answer: there was no request yet
        assert time.monotonic() - started < 3
        body_stall.close()
        header_stall.close()
        assert post(url, GOOD)[0] == 200


def test_a_trickled_body_cannot_outlive_the_timeout():
    with serving(reward_server(request_timeout_s=1.0)) as url:
        sock = stalled_upload(url)
        started = time.monotonic()
        try:
            for _ in range(30):  # one byte every 0.2 s: each read is in time, the whole body is not
                sock.sendall(b" ")
                time.sleep(0.2)
        except OSError:
            pass  # the server closed the connection
        assert time.monotonic() - started < 4
        sock.close()


def test_connections_beyond_the_cap_are_refused_at_once_and_served_later():
    server = reward_server(max_connections=2, request_timeout_s=1.5)
    with serving(server) as url:
        stalls = [stalled_upload(url) for _ in range(2)]
        deadline = time.monotonic() + 5
        while server.num_connections < 2:
            assert time.monotonic() < deadline, "the stalled uploads never reached the server"
            time.sleep(0.01)
        started = time.monotonic()
        code, answer = post(url, GOOD)
        assert code == 503 and "--max_connections" in answer["error"]
        assert time.monotonic() - started < 1  # refused without waiting for the stalled uploads
        # the client retries 503s; the stalled uploads are dropped after 1.5 s and the retry gets in
        out = RemoteRewardClient(url, timeout_s=5, retries=5, backoff_s=0.3).score(INPUTS)
        torch.testing.assert_close(out.rewards_B, torch.tensor([2.0, 4.0]))
        for sock in stalls:
            sock.close()
        deadline = time.monotonic() + 5  # the handler threads release their slots as they finish
        while server.num_connections:
            assert time.monotonic() < deadline, f"{server.num_connections} connection(s) never released"
            time.sleep(0.01)


def test_api_key_is_required_when_set_and_never_logged(monkeypatch, capsys):
    key = "s3cret-token"
    with serving(reward_server(api_key=key)) as url:
        code, answer = post(url, GOOD)
        assert code == 401 and "Authorization: Bearer" in answer["error"]
        assert post(url, GOOD, {"Authorization": "Bearer wrong"})[0] == 401
        assert post(url, GOOD, {"Authorization": f"Bearer {key}"})[0] == 200
        monkeypatch.delenv(API_KEY_ENV, raising=False)
        with pytest.raises(ValueError, match=rf"reward server {url} answered HTTP 401.*{API_KEY_ENV}"):
            RemoteRewardClient(url, timeout_s=5, retries=3).score(INPUTS)
        out = RemoteRewardClient(url, timeout_s=5, api_key=key).score(INPUTS)
        torch.testing.assert_close(out.rewards_B, torch.tensor([2.0, 4.0]))
        monkeypatch.setenv(API_KEY_ENV, key)
        out = RemoteRewardClient(url, timeout_s=5).score(INPUTS)
        torch.testing.assert_close(out.rewards_B, torch.tensor([2.0, 4.0]))
    captured = capsys.readouterr()
    assert key not in captured.out + captured.err


class _Scripted(BaseHTTPRequestHandler):
    """Answers each POST with the next behaviour in `script`; the rest are served normally."""

    script: list[str] = []
    calls = 0

    def do_POST(self):  # noqa: N802
        type(self).calls += 1
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        behaviour = type(self).script.pop(0) if type(self).script else "ok"
        data = json.dumps({"rewards": [float(len(q)) for q in body["query"]]}).encode()
        if behaviour == "close":  # no answer at all: RemoteDisconnected
            self.close_connection = True
            return
        if behaviour.isdigit():
            data = json.dumps({"error": f"scripted {behaviour}"}).encode()
        self.send_response(int(behaviour) if behaviour.isdigit() else 200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        # "truncate": promise the whole body, send half of it and close (IncompleteRead)
        self.wfile.write(data[: len(data) // 2] if behaviour == "truncate" else data)

    def log_message(self, *args):
        return


@contextmanager
def scripted(script: list[str]):
    handler = type("Handler", (_Scripted,), {"script": list(script), "calls": 0})
    with serving(ThreadingHTTPServer(("127.0.0.1", 0), handler)) as url:
        yield url, handler


@pytest.mark.parametrize("script", [["truncate"], ["close"], ["503"], ["408"], ["429"], ["truncate", "500"]])
def test_client_retries_transient_failures_then_succeeds(script):
    with scripted(script) as (url, handler):
        out = RemoteRewardClient(url, timeout_s=5, retries=3, backoff_s=0.01).score(INPUTS)
        torch.testing.assert_close(out.rewards_B, torch.tensor([2.0, 4.0]))
        assert handler.calls == len(script) + 1


@pytest.mark.parametrize("code", ["400", "404", "413"])
def test_client_does_not_retry_other_4xx(code):
    with scripted([code] * 3) as (url, handler):
        with pytest.raises(ValueError, match=rf"reward server {url} answered HTTP {code}: scripted {code}"):
            RemoteRewardClient(url, timeout_s=5, retries=3, backoff_s=0.01).score(INPUTS)
        assert handler.calls == 1


def test_client_errors_name_the_url():
    with scripted(["truncate"] * 2) as (url, _):
        with pytest.raises(RuntimeError, match=rf"reward server {url} failed 2 times.*IncompleteRead"):
            RemoteRewardClient(url, timeout_s=5, retries=2, backoff_s=0.01).score(INPUTS)
    url = f"http://127.0.0.1:{free_port()}/get_reward"  # nothing listens there
    with pytest.raises(RuntimeError, match=rf"reward server {url} failed 2 times.*refused"):
        RemoteRewardClient(url, timeout_s=1.0, retries=2, backoff_s=0.01).score(INPUTS)
