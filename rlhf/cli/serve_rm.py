"""A small HTTP reward server: `python -m rlhf.cli.serve_rm --reward_pretrain DIR[,DIR] --port 5000`
or `--remote_rm_url reward.py`. Answers POST /get_reward with {"rewards": [...]} for
{"query": [...], "prompts": [...], "labels": [...]} (what `--remote_rm_url http://host:port/get_reward`
sends). Single process, CPU or one GPU; for tests and small deployments.

Every failure is an HTTP answer with a JSON {"error": ...} body, never a dropped connection: 400 for a
malformed request, 401 without the bearer token (`--api_key` or env RLHF_RM_API_KEY), 408 for a body
not received within `--request_timeout`, 411/413 for a missing or over-cap (`--max_request_mb`)
Content-Length, 422 when the reward source rejects the samples (ValueError), 500 for any other scoring
error, and 503 when all `--max_connections` handler threads are busy."""

from __future__ import annotations

import argparse
import hmac
import json
import os
import socket
import sys
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from threading import BoundedSemaphore, Lock, Thread

import torch

from rlhf.rewards.base import RewardInputs, RewardSource
from rlhf.rewards.remote import API_KEY_ENV

_DRAIN_S = 1.0  # after an early error reply, read (and drop) the unsent body this long so the client sees the reply


class RequestError(Exception):
    """A request the server refuses before scoring: its HTTP status and a message for the client."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def build_source(args: argparse.Namespace) -> tuple[RewardSource, object | None]:
    if args.remote_rm_url:
        from rlhf.rewards.reward_func import RewardFuncFile

        return RewardFuncFile(args.remote_rm_url), None
    from rlhf.models.loading import load_tokenizer
    from rlhf.models.micro_batches import MicroBatcher
    from rlhf.models.value import load_scalar_head_model, stored_reward_norm
    from rlhf.rewards.models import RewardModelEnsemble

    paths = [p for p in args.reward_pretrain.split(",") if p]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    if args.prm:
        return build_prm_source(args, paths, device, dtype)
    models = [load_scalar_head_model(p, args.value_head_prefix, dtype, "sdpa").to(device).eval() for p in paths]
    norms = None
    if args.normalize_reward:
        norms = [stored_reward_norm(p) for p in paths]
        missing = [p for p, n in zip(paths, norms) if n is None]
        if missing:
            raise ValueError(f"--normalize_reward: {', '.join(missing)} stores no reward mean/std (train_rm writes "
                             "them when it evaluates); drop --normalize_reward to serve raw rewards")
    return RewardModelEnsemble(models, device, MicroBatcher(args.batch_size), norms), load_tokenizer(paths[0])


def build_prm_source(args: argparse.Namespace, paths: list[str], device: torch.device,
                     dtype: torch.dtype) -> tuple[RewardSource, object]:
    """A process reward model (one causal LM from train_prm) scoring the steps marked by the placeholder."""
    from rlhf.data.supervised_samples import token_id
    from rlhf.models.loading import load_causal_lm, load_tokenizer
    from rlhf.rewards.process_rewards import ProcessRewardSource

    if args.normalize_reward:
        raise ValueError("--normalize_reward applies reward-model statistics; a process reward model's step "
                         "scores are probabilities and have none: drop one of --prm / --normalize_reward")
    if len(paths) != 1 or not args.placeholder_token or not args.reward_tokens:
        raise ValueError("--prm serves one process reward model: give one --reward_pretrain directory, "
                         "--placeholder_token and --reward_tokens (the positive token first)")
    tokenizer = load_tokenizer(paths[0])
    model = load_causal_lm(paths[0], dtype, "sdpa").to(device).eval()
    return ProcessRewardSource(model, device, token_id(tokenizer, args.placeholder_token, "--placeholder_token"),
                               [token_id(tokenizer, t, "--reward_tokens") for t in args.reward_tokens],
                               args.prm_reduction, args.batch_size), tokenizer


class RewardServer(ThreadingHTTPServer):
    """Serves one reward source. Scoring is serialised (one model, one lock); at most `max_connections`
    connections are handled at once, and one beyond that is answered 503 at once (the client retries it
    like any transient error) rather than queued behind stalled uploads: at most 2 * max_connections
    threads, each dropped after `request_timeout_s` without progress."""

    def __init__(self, address: tuple[str, int], source: RewardSource, tokenizer=None, *, max_len: int = 4096,
                 max_request_mb: float = 64.0, request_timeout_s: float = 60.0, max_connections: int = 32,
                 api_key: str | None = None) -> None:
        if max_request_mb <= 0 or request_timeout_s <= 0 or max_connections < 1:
            raise ValueError("--max_request_mb and --request_timeout must be > 0 and --max_connections >= 1")
        self.source, self.tokenizer, self.max_len = source, tokenizer, max_len
        self.max_request_mb, self.request_timeout_s, self.max_connections = (max_request_mb, request_timeout_s,
                                                                             max_connections)
        self.max_request_bytes = int(max_request_mb * 2**20)
        self.api_key = api_key or None
        self.score_lock = Lock()
        self._slots = BoundedSemaphore(max_connections)
        self._refusal_slots = BoundedSemaphore(max_connections)  # 503 answers in flight (short-lived threads)
        self._count_lock = Lock()
        self.num_connections = 0  # connections being handled now (each holds one thread)
        super().__init__(address, RewardHandler)

    def process_request(self, request: socket.socket, client_address) -> None:
        if self._slots.acquire(blocking=False):
            self._count(+1)
            try:
                super().process_request(request, client_address)  # starts the handler thread
            except BaseException:
                self._release()
                raise
        elif self._refusal_slots.acquire(blocking=False):
            # answered on its own short-lived thread: a reply written before the request was read would be
            # lost to a connection reset, and the accept loop must not wait on a client
            try:
                Thread(target=self._refuse, args=(request, client_address), daemon=True).start()
            except BaseException:
                self._refusal_slots.release()
                raise
        else:  # flooded: not even a 503
            self.shutdown_request(request)

    def process_request_thread(self, request: socket.socket, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release()

    def _refuse(self, request: socket.socket, client_address) -> None:
        try:
            BusyHandler(request, client_address, self)
        except Exception:  # the client went away mid-answer: nothing to tell it
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            self._refusal_slots.release()

    def _count(self, delta: int) -> None:
        with self._count_lock:
            self.num_connections += delta

    def _release(self) -> None:
        self._count(-1)
        self._slots.release()


class RewardHandler(BaseHTTPRequestHandler):
    """One connection: check the token, read a bounded body within the deadline, score, answer JSON."""

    server: RewardServer
    _body_unread = False  # an answer sent before the body was read must drain it (see `_drain`)

    def setup(self) -> None:
        self.timeout = self.server.request_timeout_s  # StreamRequestHandler applies it to every socket read/write
        super().setup()

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        try:
            self._check_auth()
            inputs = self._parse(self._read_json())
        except RequestError as err:
            self._reply(err.code, {"error": str(err)})
            return
        except TimeoutError:
            self._reply(408, {"error": f"request body not received within --request_timeout "
                                       f"{self.server.request_timeout_s}s"})
            return
        if not inputs.queries:
            self._reply(200, {"rewards": [], "scores": [], "extra_logs": {}})
            return
        try:
            result = self._score(inputs)
        except ValueError as err:  # the source rejects these samples: retrying cannot help
            self._reply(422, {"error": str(err)})
            return
        except Exception as err:  # any scoring failure must reach the client as an answer, not a dropped socket
            self.log_message("scoring failed:\n%s", traceback.format_exc())
            self._reply(500, {"error": f"scoring failed: {type(err).__name__}: {err}"})
            return
        self._reply(200, {"rewards": result.rewards_B.tolist(), "scores": result.scores_B.tolist(),
                          "extra_logs": {k: v.tolist() for k, v in result.extra_logs.items()}})

    def _check_auth(self) -> None:
        key = self.server.api_key
        if key is None:
            return
        given = self.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            self._body_unread = True
            raise RequestError(401, "missing or wrong 'Authorization: Bearer <key>' header (the server's "
                                    f"--api_key / {API_KEY_ENV}; the trainer sends {API_KEY_ENV})")

    def _read_json(self) -> dict:
        length = self._content_length()
        deadline = time.monotonic() + self.server.request_timeout_s
        chunks, received = [], 0
        while received < length:  # one deadline for the whole body: a trickle cannot hold the thread forever
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            self.connection.settimeout(left)
            chunk = self.rfile.read1(min(length - received, 1 << 20))
            if not chunk:
                raise RequestError(400, f"body ended after {received} of {length} bytes (Content-Length)")
            chunks.append(chunk)
            received += len(chunk)
        try:
            request = json.loads(b"".join(chunks))
        except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
            raise RequestError(400, f"body is not JSON: {err}") from None
        if not isinstance(request, dict):
            raise RequestError(400, f"expected a JSON object with 'query', got {type(request).__name__}")
        return request

    def _content_length(self) -> int:
        self._body_unread = True
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            raise RequestError(411, "chunked bodies are not supported: send a Content-Length")
        raw = self.headers.get("Content-Length")
        if raw is None:
            raise RequestError(411, "missing Content-Length header")
        try:
            length = int(raw)
        except ValueError:
            raise RequestError(400, f"Content-Length {raw!r} is not an integer") from None
        if length < 0:
            raise RequestError(400, f"Content-Length {length} is negative")
        if length > self.server.max_request_bytes:
            raise RequestError(413, f"body of {length} bytes exceeds the server's cap of "
                                    f"{self.server.max_request_mb} MB (--max_request_mb); send smaller batches")
        self._body_unread = False  # from here the body is read (or the read fails and the connection closes)
        return length

    def _parse(self, request: dict) -> RewardInputs:
        queries = request.get("query")
        if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
            raise RequestError(400, "'query' must be a list of strings (got "
                                    f"{'no query' if queries is None else type(queries).__name__})")
        n = len(queries)
        prompts = request.get("prompts") or [""] * n
        labels = request.get("labels") or [None] * n
        if not isinstance(prompts, list) or len(prompts) != n or not all(isinstance(p, str) for p in prompts):
            raise RequestError(400, f"'prompts' must be a list of {n} strings, one per query")
        if not isinstance(labels, list) or len(labels) != n:
            raise RequestError(400, f"'labels' must be a list of {n} values, one per query")
        ids = mask = torch.zeros(n, 1, dtype=torch.long)
        return RewardInputs(queries, prompts, labels, ids, mask)

    def _score(self, inputs: RewardInputs):
        tokenizer = self.server.tokenizer
        if tokenizer is not None:
            enc = tokenizer(inputs.queries, padding=True, truncation=True, max_length=self.server.max_len,
                            return_tensors="pt", add_special_tokens=False)
            inputs.sequences_BT, inputs.attention_mask_BT = enc["input_ids"], enc["attention_mask"]
        with self.server.score_lock:
            return self.server.source.score(inputs)

    def _reply(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.connection.settimeout(self.server.request_timeout_s)  # the body read may have left a shorter one
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if code >= 400:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()
        if self._body_unread:
            self._drain()

    def _drain(self) -> None:
        """An answer sent before the body was read: stop writing and read (dropping) what the client is
        still sending for a moment, so closing does not reset the connection before it reads the answer."""
        deadline = time.monotonic() + min(_DRAIN_S, self.server.request_timeout_s)
        try:
            self.connection.shutdown(socket.SHUT_WR)
            while (left := deadline - time.monotonic()) > 0:
                self.connection.settimeout(left)
                if not self.rfile.read1(1 << 16):
                    return
        except OSError:  # includes the timeout: give up, the connection closes either way
            return

    def log_request(self, code="-", size="-") -> None:  # quiet for answered requests
        return

    def log_message(self, format: str, *args) -> None:  # errors and timeouts; never headers (the token)
        sys.stderr.write(f"serve_rm {self.address_string()}: {format % args}\n")


class BusyHandler(RewardHandler):
    """A connection over `--max_connections`: answers 503 to whatever request arrives within a second."""

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(min(_DRAIN_S, self.server.request_timeout_s))

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        self._body_unread = True
        self._reply(503, {"error": f"reward server busy: all {self.server.max_connections} connections "
                                   "(--max_connections) are in use; retry later"})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rlhf.cli.serve_rm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reward_pretrain", default=None, help="reward model directories, comma separated")
    parser.add_argument("--remote_rm_url", default=None, help="a .py file defining reward_func instead")
    parser.add_argument("--value_head_prefix", default="score")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--prm", action="store_true",
                        help="--reward_pretrain is a process reward model (train_prm): score each step at its "
                             "--placeholder_token, reduce over steps with --prm_reduction")
    parser.add_argument("--placeholder_token", default=None, help="with --prm: the token after each step")
    parser.add_argument("--reward_tokens", nargs="*", default=None,
                        help="with --prm: the reward tokens, the positive one first")
    parser.add_argument("--prm_reduction", default="min", choices=("min", "mean", "last"),
                        help="with --prm: one reward per sample from its step scores")
    parser.add_argument("--normalize_reward", action="store_true",
                        help="serve (reward - mean) / std with the statistics stored by train_rm")
    parser.add_argument("--max_len", type=int, default=4096)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=5000)
    parser.add_argument("--max_request_mb", type=float, default=64.0, help="larger request bodies get HTTP 413")
    parser.add_argument("--request_timeout", type=float, default=60.0,
                        help="seconds to receive a request (headers: per read; body: in total); then it is dropped")
    parser.add_argument("--max_connections", type=int, default=32,
                        help="concurrent connections (handler threads); more are answered HTTP 503")
    parser.add_argument("--api_key", default=None,
                        help=f"require 'Authorization: Bearer <key>' (default: env {API_KEY_ENV}; the env var "
                             "keeps the key out of the process list)")
    args = parser.parse_args(argv)
    if bool(args.reward_pretrain) == bool(args.remote_rm_url):
        parser.error("give exactly one of --reward_pretrain or --remote_rm_url")
    if args.max_request_mb <= 0 or args.request_timeout <= 0 or args.max_connections < 1:
        parser.error("--max_request_mb and --request_timeout must be > 0 and --max_connections >= 1")
    try:
        source, tokenizer = build_source(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    server = RewardServer((args.host, args.port), source, tokenizer, max_len=args.max_len,
                          max_request_mb=args.max_request_mb, request_timeout_s=args.request_timeout,
                          max_connections=args.max_connections, api_key=args.api_key or os.environ.get(API_KEY_ENV))
    auth = "bearer token required" if server.api_key else "no authentication (set --api_key or " + API_KEY_ENV + ")"
    print(f"serving rewards on http://{args.host}:{server.server_address[1]}/get_reward ({auth})", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
