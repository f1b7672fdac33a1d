"""The reward server with its defaults (no --api_key) under hostile and careless clients: how much of its service a
well-behaved client still gets, whether every request gets an HTTP answer, and what the server's log says.

    python benchmarks/reward_server_attacks.py [--seconds 10] [--attackers 40]

`RewardServer` with `ServerLimits()` (serve_rm's defaults) on 127.0.0.1, in this process, scoring with a source
that takes 5 ms a request (a small reward model). The well-behaved client shares the attackers' address (as
behind a NAT) and posts one valid request every 0.25 s, each a single try (the trainer's client would retry what
fails): its answers are counted. Scenarios, one after another, each --seconds long:

    quiet          no attack: the reference
    slow_bodies    --attackers clients send their headers and then one body byte every 0.5 s, reconnecting when
                   closed
    slow_headers   the same, one header byte every 0.5 s
    resets         --attackers clients loop: connect, send half a request, reset the connection (RST); and send
                   a whole request, reset before the answer
    malformed      --attackers clients loop over malformed requests (garbage, bad JSON, a wrong Content-Length,
                   an unknown method), reading each answer
    burst          (instead of the timed client) 100 valid requests at once, each a single try

Printed per scenario: the client's requests answered 200, answered otherwise (code: count), and closed without an
answer; its median and worst latency; the attackers' connections; the server's log lines and how many were
tracebacks.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import io
import json
import socket
import statistics
import struct
import threading
import time
import urllib.error
import urllib.request

import torch

from rlhf.rewards import RewardInputs
from rlhf.rewards.base import RewardResult
from rlhf.rewards.reward_server import RewardServer, ServerLimits

GOOD = json.dumps({"query": ["ab", "abcd"]}).encode()
HEAD = b"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
MALFORMED = (b"\x16\x03\x01garbage\r\n\r\n",
             HEAD + b"Content-Length: 5\r\n\r\n{nope",
             HEAD + b"Content-Length: 2\r\n\r\n[]",
             HEAD + b"Content-Length: 999999999999\r\n\r\n",
             HEAD + b"\r\n",
             b"BREW /get_reward HTTP/1.1\r\n\r\n",
             b"GET / HTTP/1.1\r\n\r\n")


class FiveMs:
    """Reward = the query's length, after 5 ms (a small model's forward)."""

    def score(self, batch: RewardInputs) -> RewardResult:
        time.sleep(0.005)
        rewards = torch.tensor([float(len(q)) for q in batch.queries])
        return RewardResult(rewards, rewards.clone())


def post_once(url: str, timeout_s: float = 10.0) -> tuple[str, float]:
    """One try: ('200' | other code | 'dropped: <error>', seconds)."""
    started = time.monotonic()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=GOOD), timeout=timeout_s) as response:
            response.read()
            outcome = str(response.status)
    except urllib.error.HTTPError as err:
        outcome = str(err.code)
    except (OSError, http.client.HTTPException) as err:  # refused, reset, timed out, closed or cut short
        outcome = f"dropped: {type(err).__name__}"
    return outcome, time.monotonic() - started


def connections(port: int, stop: threading.Event, count: list):
    """Yields (n, a new connection to the server) until `stop`, counting them in `count[0]`."""
    n = 0
    while not stop.is_set():
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        except OSError:  # not accepted in time: try again
            time.sleep(0.05)
            continue
        count[0] += 1
        yield n, sock
        n += 1


def trickler(port: int, first: bytes, stop: threading.Event, count: list) -> None:
    """Sends `first`, then a byte every 0.5 s; reconnects when the server closes the connection."""
    for _, sock in connections(port, stop, count):
        try:
            sock.sendall(first)
            while not stop.wait(0.5):
                sock.sendall(b"x")
        except OSError:  # closed by the server
            pass
        finally:
            sock.close()


def resetter(port: int, stop: threading.Event, count: list) -> None:
    """Half a request then RST; a whole request then RST before the answer; in turn."""
    whole = HEAD + b"Content-Length: %d\r\n\r\n" % len(GOOD) + GOOD
    for n, sock in connections(port, stop, count):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close() sends RST
        try:
            sock.sendall(whole[: len(whole) // 2] if n % 2 else whole)
            time.sleep(0.01)
        except OSError:
            pass
        sock.close()
        time.sleep(0.02)


def malformer(port: int, stop: threading.Event, count: list, unanswered: list) -> None:
    """MALFORMED's requests in turn, each answer read: one without an HTTP status line is counted."""
    for n, sock in connections(port, stop, count):
        try:
            sock.sendall(MALFORMED[n % len(MALFORMED)])
            answer = sock.recv(12)
        except OSError:
            answer = b""
        if not answer.startswith(b"HTTP/1."):
            unanswered[0] += 1
        sock.close()


def scenario(name: str, seconds: float, attackers: int) -> dict:
    log = io.StringIO()
    server = RewardServer(("127.0.0.1", 0), FiveMs(), None, limits=ServerLimits())
    port = server.server_address[1]
    url = f"http://127.0.0.1:{port}/get_reward"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    stop, count, unanswered = threading.Event(), [0], [0]
    with contextlib.redirect_stderr(log):
        thread.start()
        if name == "slow_bodies":
            attack = [(trickler, (port, HEAD + b"Content-Length: 1000\r\n\r\n{", stop, count))] * attackers
        elif name == "slow_headers":
            attack = [(trickler, (port, HEAD + b"X-Slow: ", stop, count))] * attackers
        elif name == "resets":
            attack = [(resetter, (port, stop, count))] * attackers
        elif name == "malformed":
            attack = [(malformer, (port, stop, count, unanswered))] * attackers
        else:
            attack = []
        threads = [threading.Thread(target=f, args=a, daemon=True) for f, a in attack]
        for t in threads:
            t.start()
        time.sleep(min(2.0, seconds / 4) if threads else 0)  # the attack is under way
        results = []
        if name == "burst":
            barrier = threading.Barrier(100)

            def one() -> None:
                barrier.wait()
                results.append(post_once(url, timeout_s=30))

            burst = [threading.Thread(target=one) for _ in range(100)]
            for t in burst:
                t.start()
            for t in burst:
                t.join()
        else:
            until = time.monotonic() + seconds
            while time.monotonic() < until:
                results.append(post_once(url))
                time.sleep(0.25)
        stop.set()
        for t in threads:
            t.join(timeout=10)
        server.shutdown()
        server.server_close()
    lines = [line for line in log.getvalue().splitlines() if line.strip()]
    outcomes: dict[str, int] = {}
    for outcome, _ in results:
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    latencies = [s for o, s in results if o == "200"]
    return {"scenario": name, "requests": len(results), "ok": outcomes.pop("200", 0),
            "answered_otherwise": {k: v for k, v in outcomes.items() if not k.startswith("dropped")},
            "dropped": sum(v for k, v in outcomes.items() if k.startswith("dropped")),
            "median_ms": round(statistics.median(latencies) * 1000, 1) if latencies else None,
            "worst_ms": round(max(latencies) * 1000, 1) if latencies else None,
            "attack_connections": count[0], "malformed_unanswered": unanswered[0],
            "log_lines": len(lines), "tracebacks": sum(line.startswith("Traceback") for line in lines),
            "log_sample": lines[:3]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--attackers", type=int, default=40)
    parser.add_argument("--scenarios", default="quiet,slow_bodies,slow_headers,resets,malformed,burst")
    args = parser.parse_args()
    print(f"{'scenario':<13} {'client: ok/sent':>16} {'other answers':>16} {'dropped':>8} {'median':>8} "
          f"{'worst':>8} {'attack conns':>13} {'log lines':>10} {'tracebacks':>11}")
    reports = []
    for name in args.scenarios.split(","):
        r = scenario(name, args.seconds, args.attackers)
        reports.append(r)
        other = ", ".join(f"{k}: {v}" for k, v in r["answered_otherwise"].items()) or "-"
        print(f"{name:<13} {r['ok']:>7}/{r['requests']:<8} {other:>16} {r['dropped']:>8} "
              f"{str(r['median_ms']) + ' ms':>8} {str(r['worst_ms']) + ' ms':>8} {r['attack_connections']:>13} "
              f"{r['log_lines']:>10} {r['tracebacks']:>11}", flush=True)
        if r["malformed_unanswered"]:
            print(f"  malformed requests closed without an HTTP answer: {r['malformed_unanswered']}")
    print(json.dumps(reports))


if __name__ == "__main__":
    main()
