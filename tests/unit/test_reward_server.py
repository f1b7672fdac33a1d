"""serve_rm's failure answers and limits (500 with the message, 400/401/405/413, the request deadline, bounded
threads, per-IP pending connections under a slow-header attack, --max_queries, --max_score_s) and the HTTP
client's retries, token and error messages. Servers run in-process in a thread. Then the model flags
(--param_dtype and --bf16, --attn_implementation, --packing_samples, --disable_fast_tokenizer, --load_in_4bit,
--use_ms: what each changes in the loaded models, or its note or refusal) and the defaults against v0.9.5's."""

import argparse
import json
import select
import socket
import struct
import threading
import time
import urllib.error
import urllib.request
import warnings
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from rlhf.assets import EMBEDDED_REWARD_MODEL_DIR
from rlhf.cli.serve_rm import build_source
from rlhf.rewards import RemoteRewardClient, RewardInputs
from rlhf.rewards.base import RewardResult
from rlhf.rewards.remote import API_KEY_ENV, backoff_schedule
from rlhf.rewards.reward_server import RewardServer, ServerLimits
from tests.distributed import free_port

INPUTS = RewardInputs(["ab", "abcd"], ["", ""], [None, None], torch.zeros(2, 1), torch.ones(2, 1))


class LengthReward:
    """Reward = number of characters in the query; extra log "words" = its number of words; sleeps `delay_s`
    per call; counts its calls."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s, self.calls = delay_s, 0

    def score(self, batch: RewardInputs) -> RewardResult:
        self.calls += 1
        time.sleep(self.delay_s)
        rewards = torch.tensor([float(len(q)) for q in batch.queries])
        return RewardResult(rewards, rewards.clone(), {"words": torch.tensor([float(len(q.split())) for q in
                                                                              batch.queries])})


class Raises:
    def __init__(self, err: Exception) -> None:
        self.err, self.calls = err, 0

    def score(self, batch: RewardInputs) -> RewardResult:
        self.calls += 1
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


def reward_server(source=None, *, api_key: str | None = None, score_chunk: int = 0, **limits) -> RewardServer:
    return RewardServer(("127.0.0.1", 0), source or LengthReward(), None, limits=ServerLimits(**limits),
                        score_chunk=score_chunk, api_key=api_key)


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


def port_of(url: str) -> int:
    return int(url.split(":")[2].split("/")[0])


def partial_request(url: str, head: bytes) -> socket.socket:
    """A client that sends the start of a request (`head`) and then nothing."""
    sock = socket.create_connection(("127.0.0.1", port_of(url)), timeout=10)
    sock.sendall(head)
    return sock


def closed_by_server(sock: socket.socket, wait_s: float) -> bool:
    """Whether the server closes `sock` within `wait_s` seconds without sending anything."""
    if not select.select([sock], [], [], wait_s)[0]:
        return False
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def wait_for(condition, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_any_scoring_error_is_a_500_with_the_message_that_the_client_does_not_retry(capsys):
    source = Raises(KeyError("no_such_column"))
    with serving(reward_server(source)) as url:
        code, body = post(url, GOOD)
        assert code == 500
        assert "KeyError" in body["error"] and "no_such_column" in body["error"]
        # the same samples fail the same way: the client names the server and its message after one try
        with pytest.raises(RuntimeError, match=rf"reward server {url} answered HTTP 500: .*no_such_column.*"
                                               "not retried"):
            RemoteRewardClient(url, timeout_s=5, retries=3, backoff_s=0.01).score(INPUTS)
        assert source.calls == 2  # post() once, the client once
    assert "no_such_column" in capsys.readouterr().err  # the traceback is logged server-side


def test_the_client_sleeps_at_most_two_seconds_between_tries(monkeypatch):
    """The chaos run's --remote_rm_retries 8: doubling sleeps would reach 16 and 32 s, so a server back after 20 s
    was tried again only at 31.5 s, past the other ranks' 30 s --dist_timeout (measured under load)."""
    assert backoff_schedule(0.5, 8) == [0.5, 1.0, 2.0, 2.0, 2.0, 2.0, 2.0]
    assert backoff_schedule(0.5, 1) == []
    slept = []
    monkeypatch.setattr("rlhf.rewards.remote.time.sleep", slept.append)
    with socket.socket() as s:  # a port nothing listens on: every try is refused
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}/get_reward"
    with pytest.raises(RuntimeError, match="failed 5 times"):
        RemoteRewardClient(closed, timeout_s=5, retries=5, backoff_s=0.5).score(INPUTS)
    assert slept == [0.5, 1.0, 2.0, 2.0]


def test_retries_whose_sleeps_outlast_the_dist_timeout_are_warned_of():
    """The chaos run's failure as a flag check: 20 tries sleep 0.5 + 1 + 2 x 17 = 35.5 s between them, longer than
    --dist_timeout 0.5 (30 s), so the waiting ranks would time out while the client still retries."""
    import warnings

    from rlhf.config.ppo_config import RewardConfig
    from rlhf.trainers.ppo_run import warn_if_retries_outlast

    with pytest.warns(UserWarning, match=r"^--remote_rm_retries 20: the reward client sleeps 35.5 s in all between "
                                         r"its tries \(at most 2 s each\), longer than --dist_timeout 0.5 min: .* "
                                         "raise --dist_timeout or lower --remote_rm_retries"):
        warn_if_retries_outlast(RewardConfig(remote_rm_retries=20), 0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_retries_outlast(RewardConfig(remote_rm_retries=16), 0.5)  # 27.5 s
        warn_if_retries_outlast(RewardConfig(), 30.0)  # the defaults: 3 tries, 30 minutes


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
        assert post(url, GOOD) == (200, {"rewards": [2.0, 4.0], "scores": [2.0, 4.0],
                                         "extra_logs": {"words": [1.0, 1.0]}})


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
    server = reward_server(LengthReward(delay_s=1.0), max_connections=2)
    with serving(server) as url:
        # two whole requests, scored one after the other for a second each: trusted, never closed to make room
        busy = [threading.Thread(target=post, args=(url, GOOD)) for _ in range(2)]
        for thread in busy:
            thread.start()
        wait_for(lambda: server.num_connections == 2 and server.num_pending == 0,
                 "the scored requests never reached the server")
        started = time.monotonic()
        code, answer = post(url, GOOD)
        assert code == 503 and "--max_connections" in answer["error"]
        assert time.monotonic() - started < 1  # refused without waiting for the scoring
        # the client retries 503s; the scored requests end within 2 s and the retry gets in
        out = RemoteRewardClient(url, timeout_s=5, retries=5, backoff_s=0.3).score(INPUTS)
        torch.testing.assert_close(out.rewards_B, torch.tensor([2.0, 4.0]))
        for thread in busy:
            thread.join()
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


def test_trickled_headers_cannot_outlive_the_request_deadline():
    with serving(reward_server(request_timeout_s=1.0)) as url:
        sock = partial_request(url, b"POST /get_reward HTTP/1.1\r\nX-Slow: ")
        started, closed_after_s = time.monotonic(), None
        for _ in range(25):  # one header byte every 0.2 s: each read is in time, the whole request is not
            try:
                sock.sendall(b"x")
            except OSError:  # reset: the server closed it
                closed_after_s = time.monotonic() - started
                break
            if closed_by_server(sock, 0.2):
                closed_after_s = time.monotonic() - started
                break
        sock.close()
        assert closed_after_s is not None and 0.5 < closed_after_s < 4
        assert post(url, GOOD)[0] == 200


def test_a_wrong_token_is_answered_401_as_soon_as_its_header_arrives():
    with serving(reward_server(api_key="s3cret", request_timeout_s=30)) as url:
        # the rest of the headers never comes: the 401 must not wait for them (nor for the 30 s deadline)
        sock = partial_request(url, b"POST /get_reward HTTP/1.1\r\nAuthorization: Bearer wrong\r\nX-Slow: ")
        sock.settimeout(5)
        started = time.monotonic()
        answer = read_all(sock)
        assert answer.startswith(b"HTTP/1.0 401") and b"Authorization: Bearer <key>" in answer
        assert time.monotonic() - started < 3
        sock.close()


def test_pending_connections_per_ip_are_capped_by_closing_the_oldest():
    # --slow_client_s 0: every pending connection may be closed for room at once
    server = reward_server(api_key="k", max_connections_per_ip=2, request_timeout_s=30, slow_client_s=0)
    with serving(server) as url:
        # the right token, then the rest of the headers late: trusted from the token's line on
        keyed = partial_request(url, b"POST /get_reward HTTP/1.1\r\nAuthorization: Bearer k\r\n")
        wait_for(lambda: server.num_connections == 1 and server.num_pending == 0, "the keyed client was not trusted")
        slow = [partial_request(url, b"POST /get_reward HTTP/1.1\r\nX-Slow: ") for _ in range(4)]
        wait_for(lambda: server.num_evicted == 2, "the slow clients were not capped")
        assert (server.num_connections, server.num_pending) == (3, 2)
        assert [closed_by_server(sock, 0.5) for sock in slow] == [True, True, False, False]  # the oldest went
        keyed.sendall(b"Content-Length: %d\r\n\r\n" % len(GOOD) + GOOD)
        assert read_all(keyed).startswith(b"HTTP/1.0 200")
        for sock in [keyed, *slow]:
            sock.close()


def trickle(port: int, first: bytes, interval_s: float, stop: threading.Event, connected: list) -> None:
    """A slow client: sends `first`, then one byte every `interval_s`; when the server closes the connection it
    opens another (at most 20), until `stop`."""
    for _ in range(20):
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        except OSError:  # not accepted in time: try again
            continue
        connected.append(sock)
        try:
            sock.sendall(first)
            while not stop.wait(interval_s):
                sock.sendall(b"x")
                if closed_by_server(sock, 0):
                    break
        except OSError:  # reset by the server
            pass
        finally:
            sock.close()
        if stop.is_set():
            return


SLOW_HEADERS = b"POST /get_reward HTTP/1.1\r\nX-Slow: "
SLOW_BODY = b"POST /get_reward HTTP/1.1\r\nContent-Length: 1000\r\n\r\n{"


@pytest.mark.parametrize("key, first", [("s3cret", SLOW_HEADERS), (None, SLOW_BODY)], ids=["keyed", "defaults"])
def test_a_client_is_served_while_40_slow_clients_are_connected(capsys, key, first):
    """The slow-header attack on a keyed server, and the slow-body attack on the default one (no key; a connection
    was trusted once its headers were in, and the client got only 503s): 40 clients on the client's own address,
    each sending a byte every 0.5 s and reconnecting when closed. Default --max_connections (32),
    --max_connections_per_ip (8) and --slow_client_s (0.25); a 30 s --request_timeout, so no slot is freed by the
    deadline while the test runs. benchmarks/reward_server_attacks.py measures the share served at the first try."""
    stop, connected = threading.Event(), []
    server = reward_server(api_key=key, request_timeout_s=30)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with serving(server) as url:
        attackers = [threading.Thread(target=trickle, args=(port_of(url), first, 0.5, stop, connected), daemon=True)
                     for _ in range(40)]
        for thread in attackers:
            thread.start()
        try:
            # all 40 in, and 20 more since: the closed ones are coming back
            wait_for(lambda: len(connected) >= 60 and server.num_evicted >= 20, "the attack did not start")
            latencies_s, codes = [], []
            for _ in range(5):  # one try each: answered (a 503 while every slot holds a connection not yet slow)
                code, answer = post(url, GOOD, headers, timeout=10)
                codes.append(code)
                assert code == 503 or answer["rewards"] == [2.0, 4.0]
            assert set(codes) <= {200, 503}, codes
            for _ in range(5):  # the trainer's client, which retries a 503: served every time
                started = time.monotonic()
                out = RemoteRewardClient(url, timeout_s=10, retries=5, backoff_s=0.3, api_key=key).score(INPUTS)
                latencies_s.append(time.monotonic() - started)
                torch.testing.assert_close(out.rewards_B, torch.tensor([2.0, 4.0]))
            if key:  # and without the token: refused, not queued (after 503s while every slot is held, as above)
                tries = []
                while len(tries) < 10 and (not tries or tries[-1] == 503):
                    time.sleep(0.3 if tries else 0)  # the client's backoff above
                    tries.append(post(url, GOOD)[0])
                assert tries[-1] == 401, tries
            assert server.num_connections <= 32
            assert all(thread.is_alive() for thread in attackers)  # the attack ran throughout
        finally:
            stop.set()
            for thread in attackers:
                thread.join(timeout=10)
    assert max(latencies_s) < 5  # a bound for a loaded machine, not a performance goal
    with capsys.disabled():
        print(f"\n{'keyed' if key else 'default'} server, client under 40 slow clients: first tries {codes}, served "
              f"with retries in {' '.join(f'{s * 1000:.0f}' for s in latencies_s)} ms, {len(connected)} slow "
              f"connections, {server.num_evicted} closed to make room")


def test_a_burst_of_100_clients_gets_answers_not_closed_connections():
    """100 valid requests at once from one address, one try each: every one is answered, 200 or 503 (retried by
    the trainer's client). Connections not yet read were closed to make room for newer ones (7-13 of 100 had no
    answer)."""
    server = reward_server(LengthReward(delay_s=0.005))
    codes, barrier = [], threading.Barrier(100)

    def one(url: str) -> None:
        barrier.wait()
        try:
            codes.append(post(url, GOOD, timeout=30)[0])
        except OSError as err:  # closed without an answer
            codes.append(type(err).__name__)

    with serving(server) as url:
        burst = [threading.Thread(target=one, args=(url,)) for _ in range(100)]
        for thread in burst:
            thread.start()
        for thread in burst:
            thread.join()
    assert len(codes) == 100 and set(codes) <= {200, 503}, (sorted(map(str, codes)), server.num_evicted)
    assert codes.count(200) >= 10, codes.count(200)


def test_resets_are_one_log_line_and_garbage_gets_a_status_line(capfd):
    """A connection reset while its request is scored was a traceback in the log; a garbled request line was
    answered with a bare JSON body (HTTP/0.9)."""
    server = reward_server(LengthReward(delay_s=0.2))
    with serving(server) as url:
        sock = partial_request(url, b"POST /get_reward HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(GOOD) + GOOD)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        wait_for(lambda: server.num_connections == 1 and server.num_pending == 0, "the request was not read")
        sock.close()  # RST while it is scored: the answer cannot be written
        wait_for(lambda: server.num_connections == 0, "the reset connection was not released")
        garbage = partial_request(url, b"\x16\x03\x01garbage\r\n\r\n")  # a TLS hello, say
        assert read_all(garbage).startswith(b"HTTP/1.0 400 ")
        garbage.close()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception occurred" not in err, err
    assert err.count("connection ended before its answer: ConnectionResetError") == 1, err


def test_other_methods_get_a_json_405_naming_post():
    with serving(reward_server()) as url:
        for method in ("GET", "PUT", "DELETE"):
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=5)
            assert err.value.code == 405 and err.value.headers["Allow"] == "POST"
            assert err.value.headers["Content-Type"] == "application/json"
            assert json.loads(err.value.read()) == {"error": f"method {method} not allowed: POST a JSON body "
                                                             "to /get_reward"}
        sock = partial_request(url, b"BREW /get_reward HTTP/1.0\r\n\r\n")  # unknown to HTTP: 501, also JSON
        head, _, body = read_all(sock).partition(b"\r\n\r\n")
        sock.close()
        assert head.startswith(b"HTTP/1.0 501") and "BREW" in json.loads(body)["error"]
        assert post(url, GOOD)[0] == 200


def test_more_queries_than_max_queries_is_a_413_naming_the_flag():
    source = LengthReward()
    with serving(reward_server(source)) as url:  # the default --max_queries
        body = json.dumps({"query": ["w"] * 200_000}).encode()  # about 1 MB
        code, answer = post(url, body)
        assert code == 413
        assert answer["error"] == ("200000 queries exceed the server's limit of 16384 per request (--max_queries); "
                                   "send smaller batches")
        with pytest.raises(ValueError, match=rf"reward server {url} answered HTTP 413: 20000 queries exceed"):
            RemoteRewardClient(url, timeout_s=5, retries=3, backoff_s=5.0).score(  # not retried: no 5 s sleep
                RewardInputs(["w"] * 20_000, [""] * 20_000, [None] * 20_000, torch.zeros(1, 1), torch.ones(1, 1)))
        assert source.calls == 0
        assert post(url, GOOD)[0] == 200


def test_scoring_in_chunks_gives_the_whole_request_result():
    queries = ["a", "bb c", "ddd", "e f g h", "iiiii"]
    body = json.dumps({"query": queries}).encode()
    with serving(reward_server(score_chunk=0)) as url:
        whole = post(url, body)
    source = LengthReward()
    with serving(reward_server(source, score_chunk=2)) as url:
        assert post(url, body) == whole == (200, {"rewards": [1.0, 4.0, 3.0, 7.0, 5.0],
                                                  "scores": [1.0, 4.0, 3.0, 7.0, 5.0],
                                                  "extra_logs": {"words": [1.0, 2.0, 1.0, 4.0, 1.0]}})
    assert source.calls == 3


def test_scoring_past_max_score_s_is_a_413_and_frees_the_lock():
    source = LengthReward(delay_s=0.1)  # 0.1 s per chunk of 2 queries: 10 chunks = 1 s, budget 0.25 s
    server = reward_server(source, score_chunk=2, max_score_s=0.25)
    with serving(server) as url:
        code, answer = post(url, json.dumps({"query": ["ab"] * 20}).encode())
        assert code == 413 and "budget of 0.25s per request (--max_score_s)" in answer["error"]
        assert source.calls <= 3  # 3 chunks take >= 0.3 s: the budget stops it before the 4th
        assert f"with {2 * source.calls} of 20 queries scored" in answer["error"]
        assert server.score_lock.acquire(blocking=False)
        server.score_lock.release()
        assert post(url, GOOD)[0] == 200  # one chunk: within the budget


def test_a_reward_func_past_max_score_s_is_a_413_and_frees_the_lock(tmp_path):
    path = tmp_path / "reward.py"
    path.write_text("import time\n\ndef reward_func(queries, prompts, labels):\n"
                    "    if 'slow' in queries:\n        time.sleep(3)\n    return [float(len(q)) for q in queries]\n")
    source, tokenizer = build_source(argparse.Namespace(remote_rm_url=str(path), max_score_s=0.3))
    server = RewardServer(("127.0.0.1", 0), source, tokenizer, limits=ServerLimits(max_score_s=0.3))
    with serving(server) as url:
        started = time.monotonic()
        code, answer = post(url, json.dumps({"query": ["slow", "ab"]}).encode())
        assert code == 413 and answer["error"].startswith("reward_func did not return within the server's "
                                                          "budget of 0.3s per request (--max_score_s) for 2 queries")
        assert time.monotonic() - started < 2.5  # answered without waiting for the call (it runs on, unlocked)
        assert server.score_lock.acquire(blocking=False)
        server.score_lock.release()
        assert post(url, GOOD) == (200, {"rewards": [2.0, 4.0], "scores": [2.0, 4.0], "extra_logs": {}})


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


@pytest.mark.parametrize("script", [["truncate"], ["close"], ["502"], ["503"], ["504"], ["408"], ["429"],
                                    ["truncate", "502"]])
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


def test_client_does_not_retry_a_500():
    with scripted(["500"] * 3) as (url, handler):
        with pytest.raises(RuntimeError, match=rf"reward server {url} answered HTTP 500: scripted 500 .*not retried"):
            RemoteRewardClient(url, timeout_s=5, retries=3, backoff_s=0.01).score(INPUTS)
        assert handler.calls == 1


def test_client_errors_name_the_url():
    with scripted(["truncate"] * 2) as (url, _):
        with pytest.raises(RuntimeError, match=rf"reward server {url} failed 2 times.*IncompleteRead"):
            RemoteRewardClient(url, timeout_s=5, retries=2, backoff_s=0.01).score(INPUTS)
    url = f"http://127.0.0.1:{free_port()}/get_reward"  # nothing listens there
    with pytest.raises(RuntimeError, match=rf"reward server {url} failed 2 times.*refused"):
        RemoteRewardClient(url, timeout_s=1.0, retries=2, backoff_s=0.01).score(INPUTS)


# --- the model flags (OpenRLHF v0.9.5's --param_dtype, --attn_implementation, --disable_fast_tokenizer,
# --load_in_4bit, --packing_samples, --use_ms) and the defaults -------------------------------------------------

TEXTS = ["x copy 3 : 3 3 3 3 </s>", "x copy 3 : 5 a 7 b </s> and a longer tail", "copy 7 : 7"]


@pytest.fixture
def cpu_only(monkeypatch):
    """This machine as one without CUDA, so the machine-dependent choices are the same on every test host."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def loaded(*argv: str):
    """(parsed flags, source, tokenizer) of `serve_rm --reward_pretrain <the tiny reward model> *argv`, built
    as main builds it, with the warnings it raised."""
    from rlhf.cli.serve_rm import build_parser, model_loading

    args = build_parser().parse_args(["--reward_pretrain", EMBEDDED_REWARD_MODEL_DIR, *argv])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        source, tokenizer = build_source(args, model_loading(args))
    return source, tokenizer, [str(w.message) for w in caught]


def scores(source, tokenizer) -> torch.Tensor:
    enc = tokenizer(TEXTS, return_tensors="pt", padding=True, add_special_tokens=False)
    return source.score(RewardInputs(TEXTS, TEXTS, [None] * 3, enc["input_ids"], enc["attention_mask"])).rewards_B


def run_main(monkeypatch, capsys, *argv: str) -> tuple[int | None, str]:
    """serve_rm.main on `argv` with the serving loop stubbed out: (exit status or None, stderr)."""
    from rlhf.cli import serve_rm

    monkeypatch.setattr(serve_rm.RewardServer, "serve_forever", lambda self, *a, **kw: None)
    try:
        serve_rm.main([*argv, "--port", "0"])
        code = None
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def test_defaults_are_v095s_but_host_and_batch_size_which_say_why(capsys):
    from rlhf.cli.serve_rm import build_parser, main

    args = build_parser().parse_args([])
    assert (args.param_dtype, args.attn_implementation, args.max_len) == ("bf16", "flash_attention_2", 2048)
    assert not (args.bf16 or args.disable_fast_tokenizer or args.load_in_4bit or args.packing_samples or args.use_ms)
    assert (args.host, args.batch_size, args.port) == ("127.0.0.1", 16, 5000)  # v0.9.5: 0.0.0.0, None, 5000
    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "this machine only, because the server has no authentication unless --api_key is set" in help_text
    assert "OpenRLHF's default is the whole request in one forward, which a large request runs out of memory" \
           in help_text
    assert RewardServer(("127.0.0.1", 0), LengthReward()).max_len == 2048  # the constructor's default too


def test_param_dtype_is_the_models_dtype_and_bf16_its_alias(cpu_only):
    (exact, tok, _), (default, _, _), (alias, _, _) = loaded("--param_dtype", "fp32"), loaded(), loaded("--bf16")
    for source, dtype in ((exact, torch.float32), (default, torch.bfloat16), (alias, torch.bfloat16)):
        model = source.models[0]
        assert {p.dtype for p in model.parameters()} == {dtype}
    reference = scores(build_source(argparse.Namespace(  # an in-process caller's default: exact fp32
        reward_pretrain=EMBEDDED_REWARD_MODEL_DIR, remote_rm_url=None, value_head_prefix="score", batch_size=4,
        prm=False, normalize_reward=False))[0], tok)
    torch.testing.assert_close(scores(exact, tok), reference)
    bf16 = scores(default, tok)
    torch.testing.assert_close(bf16, reference, atol=0.05, rtol=0.05)
    assert not torch.equal(bf16, reference)  # rounded to bf16 weights, not silently fp32
    torch.testing.assert_close(scores(alias, tok), bf16)


@pytest.mark.parametrize("argv, message", [
    (["--bf16", "--param_dtype", "fp32"], "error: --bf16 contradicts --param_dtype fp32: give one of them"),
    (["--param_dtype", "fp16"], "error: --param_dtype fp16 needs CUDA (CPU half-precision kernels are slow and "
                                "incomplete); on CPU pass --param_dtype bf16 (the default) or --param_dtype fp32"),
    (["--load_in_4bit"], "error: --load_in_4bit needs a CUDA GPU: bitsandbytes' 4-bit weights have no CPU path; "
                         "drop --load_in_4bit on this machine"),
    (["--load_in_4bit", "--param_dtype", "fp32"], "error: --load_in_4bit computes in bf16: drop --param_dtype fp32 "
                                                  "(bf16 is the default)"),
])
def test_what_cpu_cannot_run_is_refused_in_one_line_naming_the_fix(cpu_only, monkeypatch, capsys, argv, message):
    code, err = run_main(monkeypatch, capsys, "--reward_pretrain", EMBEDDED_REWARD_MODEL_DIR, *argv)
    assert code == 2
    assert [line for line in err.splitlines() if line.startswith("error:")] == [message]


def test_load_in_4bit_needs_bitsandbytes_on_cuda(monkeypatch):
    import importlib.util

    from rlhf.cli import serve_rm

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else
                        real(name, *a))
    with pytest.raises(ValueError, match="--load_in_4bit needs the bitsandbytes package: pip install bitsandbytes"):
        serve_rm.check_4bit()


def test_load_in_4bit_reaches_the_model_loader(cpu_only, monkeypatch):
    """Where 4-bit can run (faked here: the checks pass), the reward model is loaded in 4 bits, computing in bf16
    (the loader's NF4 config; a real 4-bit load needs the GPU, tests/gpu)."""
    from rlhf.cli import serve_rm
    from rlhf.models import value

    monkeypatch.setattr(serve_rm, "check_4bit", lambda: None)
    seen = {}
    real = value.load_scalar_head_model

    def spy(path, prefix, dtype, attn, *args, load_in_4bit=False, **kwargs):
        seen.update(dtype=dtype, load_in_4bit=load_in_4bit)
        return real(path, prefix, dtype, attn, *args, **kwargs)  # loaded unquantised: there is no GPU here

    monkeypatch.setattr(value, "load_scalar_head_model", spy)
    source, _, _ = loaded("--load_in_4bit", "--attn_implementation", "sdpa")
    assert seen == {"dtype": torch.bfloat16, "load_in_4bit": True}
    assert len(source.models) == 1


def test_attn_implementation_is_the_models_attention(cpu_only):
    (default, _, notes), (eager, _, eager_notes) = loaded(), loaded("--attn_implementation", "eager")
    assert default.models[0].base.config._attn_implementation == "sdpa"
    assert notes == ["--attn_implementation flash_attention_2 (the default): there is no CUDA device, so attention "
                     "runs on PyTorch SDPA instead of flash-attn (pass --attn_implementation sdpa to silence this)"]
    assert eager.models[0].base.config._attn_implementation == "eager" and eager_notes == []


def test_packing_samples_scores_packed_rows_as_the_padded_ones(cpu_only):
    from rlhf.models.attention import VARLEN_ATTENTION

    (padded, tok, _), (packed, _, notes) = (loaded("--param_dtype", "fp32", "--attn_implementation", "sdpa"),
                                            loaded("--param_dtype", "fp32", "--packing_samples"))
    assert notes == []  # the default attention is no request to warn about: packed rows run varlen attention
    assert packed.batcher.layout.packing and not padded.batcher.layout.packing
    assert packed.models[0].base.config._attn_implementation == VARLEN_ATTENTION
    torch.testing.assert_close(scores(packed, tok), scores(padded, tok), atol=1e-5, rtol=1e-5)
    _, _, eager_notes = loaded("--param_dtype", "fp32", "--packing_samples", "--attn_implementation", "eager")
    assert eager_notes == ["--attn_implementation eager has no effect with --packing_samples: packed rows run the "
                           "packed varlen attention (flash-attn where it runs, else PyTorch's kernels)"]


def test_disable_fast_tokenizer_asks_for_the_slow_tokenizer(cpu_only, monkeypatch):
    import transformers

    (_, fast, _), (_, slow, notes) = (loaded("--attn_implementation", "sdpa"),
                                      loaded("--attn_implementation", "sdpa", "--disable_fast_tokenizer"))
    assert fast.is_fast
    if int(transformers.__version__.split(".")[0]) >= 5:  # no slow classes, and the tiny model has no sentencepiece
        assert slow.is_fast and len(notes) == 1 and notes[0].startswith(
            f"--disable_fast_tokenizer has no effect on {EMBEDDED_REWARD_MODEL_DIR}: transformers")
    seen = []
    real = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda path, **kwargs: seen.append(kwargs) or real(path, **kwargs))
    monkeypatch.setattr(transformers, "__version__", "4.57.0")  # a release with slow tokenizers: OpenRLHF's call
    loaded("--attn_implementation", "sdpa", "--disable_fast_tokenizer")
    loaded("--attn_implementation", "sdpa")
    assert seen[0]["use_fast"] is False and "use_fast" not in seen[1]


def test_notes_are_printed_one_line_each_and_the_server_starts(cpu_only, monkeypatch, capsys):
    code, err = run_main(monkeypatch, capsys, "--reward_pretrain", EMBEDDED_REWARD_MODEL_DIR, "--use_ms")
    assert code is None
    notes = [line for line in err.splitlines() if line.startswith("UserWarning: ")]
    assert notes == [
        "UserWarning: --use_ms is ignored: models and datasets are read from local paths only; nothing is "
        "downloaded (from ModelScope or the Hugging Face hub): pass local directories",
        "UserWarning: --attn_implementation flash_attention_2 (the default): there is no CUDA device, so attention "
        "runs on PyTorch SDPA instead of flash-attn (pass --attn_implementation sdpa to silence this)"]


def test_model_flags_with_a_reward_function_get_a_note_each(monkeypatch, capsys):
    from rlhf.assets import TINY_DIR

    code, err = run_main(monkeypatch, capsys, "--remote_rm_url", str(TINY_DIR / "reward.py"), "--load_in_4bit",
                         "--packing_samples", "--param_dtype", "fp16")
    assert code is None
    assert [line for line in err.splitlines() if line.startswith("UserWarning: ")] == [
        f"UserWarning: --{flag} is ignored with --remote_rm_url: no reward model is loaded"
        for flag in ("param_dtype", "load_in_4bit", "packing_samples")]


def test_packing_samples_with_a_process_reward_model_gets_a_note(cpu_only):
    from rlhf.cli.serve_rm import build_parser, model_loading

    args = build_parser().parse_args(["--reward_pretrain", "prm", "--prm", "--packing_samples",
                                      "--attn_implementation", "sdpa"])
    with pytest.warns(UserWarning, match="--packing_samples is ignored with --prm: the process reward model scores "
                                         "padded rows"):
        assert not model_loading(args).packing_samples


def test_a_busy_port_is_named_before_the_model_loads(monkeypatch, capsys):
    """Another process listening on --port: one error line naming host and port, before any model loads (it was a
    traceback after the model had loaded); a port taken while the model loads gets the same line."""
    import socket

    from rlhf.cli import serve_rm

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        monkeypatch.setattr(serve_rm, "build_source", lambda *a: pytest.fail("the model loaded first"))
        with pytest.raises(SystemExit) as exc:
            serve_rm.main(["--reward_pretrain", EMBEDDED_REWARD_MODEL_DIR, "--port", str(port)])
        assert exc.value.code == 2
        assert capsys.readouterr().err.strip() == (
            f"error: --host 127.0.0.1 --port {port}: cannot listen there (Address already in use); stop what "
            "listens on that port or pick another --port")
        monkeypatch.setattr(serve_rm, "check_port_free", lambda host, port: None)  # taken during the load
        monkeypatch.setattr(serve_rm, "build_source", lambda *a: (LengthReward(), None))
        with pytest.raises(SystemExit):
            serve_rm.main(["--reward_pretrain", EMBEDDED_REWARD_MODEL_DIR, "--port", str(port)])
        assert capsys.readouterr().err.strip().endswith("(Address already in use); stop what listens on that port "
                                                         "or pick another --port")
