"""The reward server's HTTP side, for `python -m rlhf.cli.serve_rm` (which builds the reward source from its
flags): one `RewardSource` behind POST /get_reward.

Every failure is an HTTP answer with a JSON {"error": ...} body, never a dropped connection: 400 for a
malformed request, 401 without the bearer token (`--api_key` or env RLHF_RM_API_KEY), 405 (with `Allow: POST`)
for any other method, 408 for a body not received within `--request_timeout` of connecting, 411/413 for a
missing or over-cap (`--max_request_mb`) Content-Length, 413 also for more than `--max_queries` queries or
scoring past `--max_score_s`, 422 when the reward source rejects the samples (ValueError), 500 for any other
scoring error, and 503 when all `--max_connections` connections are taken by trusted requests. A 500 is a fault
of the source on these samples, which the same request hits again: the client (rlhf.rewards.remote) does not
retry it, nor any 4xx but 408/429; it retries connection errors, timeouts, 502, 503 and 504.

Slow clients. A connection must deliver its whole request, headers and body, within `--request_timeout` of
being accepted: one deadline, not a timeout per read, so a byte every few seconds does not extend it (headers
not in by then: closed without an answer). The bearer token is checked the moment its header line arrives: a
wrong one is answered 401 at once; a right one makes the connection trusted. Without `--api_key` a connection
is trusted once its whole request, body included, is in. Until then a connection is pending, and once it has
been pending for `--slow_client_s` (0.25 s) it is slow: a slow-header or slow-body attack is made of slow
connections. A slow connection may be closed to make room: a newcomer from an IP with
`--max_connections_per_ip` pending connections closes that IP's oldest slow one, and a newcomer that finds every
slot taken closes the oldest slow one of all; with none to close it is answered 503. Trusted connections, and
pending ones not yet slow (a burst the handler threads have not reached), are never closed for room, so a burst
of well-behaved clients gets answers (200 or 503, which the trainer's client retries), not closed connections.
Closing the oldest slow one, not refusing the newest, is what keeps a well-behaved client served when the
attacker shares its address (a NAT, or 127.0.0.1 in the tests): it sends its request with the connection and is
trusted within milliseconds; a slow one is the first to go. A connection the client resets or leaves is one
log line, not a traceback. Not covered: new connections from one IP at more than --max_connections per
--slow_client_s (128 a second by default) hold every slot with connections not yet slow, and other clients get
503s meanwhile (answered, and retried by the trainer's client)."""
from __future__ import annotations

import hmac
import io
import json
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from threading import BoundedSemaphore, Lock, Thread

import torch

from rlhf.rewards.base import RewardInputs, RewardResult, RewardSource
from rlhf.rewards.remote import API_KEY_ENV
from rlhf.rewards.reward_func import RewardFuncTimeout

_DRAIN_S = 1.0  # after an early error reply, read (and drop) the unsent body this long so the client sees the reply


class RequestError(Exception):
    """A request the server refuses: its HTTP status and a message for the client."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class _NoRequest(ConnectionAbortedError):
    """The connection ends with no request to answer: the server closed it to make room while it was pending,
    or the client closed it before the end of its headers."""


@dataclass(frozen=True, kw_only=True)
class ServerLimits:
    """What one request and one client may take (see the module docstring); one flag each."""

    max_request_mb: float = 64.0
    """largest request body, MB (--max_request_mb); a larger Content-Length is answered 413"""
    request_timeout_s: float = 60.0
    """seconds from accepting a connection to having its whole request, headers and body (--request_timeout)"""
    max_connections: int = 32
    """connections handled at once, one thread each (--max_connections); beyond that: 503"""
    max_connections_per_ip: int = 8
    """pending connections (token, or without --api_key the whole request, not yet in) kept per source IP before
    a newcomer from it closes its oldest slow one (--max_connections_per_ip)"""
    slow_client_s: float = 0.25
    """seconds a connection may stay pending before it is slow and may be closed to make room (--slow_client_s)"""
    max_queries: int = 16384
    """queries in one request (--max_queries); more are answered 413"""
    max_score_s: float = 60.0
    """seconds one request may hold the scoring lock (--max_score_s); past it the rest is refused (413)"""

    def __post_init__(self) -> None:
        for flag, value in (("--max_request_mb", self.max_request_mb), ("--request_timeout", self.request_timeout_s),
                            ("--max_connections", self.max_connections), ("--max_queries", self.max_queries),
                            ("--max_connections_per_ip", self.max_connections_per_ip),
                            ("--max_score_s", self.max_score_s)):
            if not value > 0:
                raise ValueError(f"{flag} must be > 0, got {value}")
        if not self.slow_client_s >= 0:
            raise ValueError(f"--slow_client_s must be >= 0, got {self.slow_client_s}")


@dataclass(eq=False)
class _Connection:
    """An accepted connection and its handler thread. `accepted` (time.monotonic()); `deadline` bounds every read
    of its request; `pending`: not yet trusted, so once slow it may be closed to make room; `evicted`: it was
    closed to make room (no slot held)."""

    sock: socket.socket
    ip: str
    accepted: float
    deadline: float
    pending: bool = True
    evicted: bool = False


class _DeadlineReader(io.RawIOBase):
    """A connection's socket reads, all bounded by `conn.deadline`: one deadline, not a timeout per read."""

    def __init__(self, conn: _Connection) -> None:
        super().__init__()
        self.conn = conn

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        left = self.conn.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("request deadline passed")
        self.conn.sock.settimeout(left)
        received = self.conn.sock.recv_into(buffer)
        if self.conn.evicted:  # the server shut the socket down to make room, which ended this read
            raise _NoRequest
        return received


class _RequestReader(io.BufferedReader):
    """A handler's rfile over a `_DeadlineReader`. Every line read with readline (the request line and the
    headers; the body is read with read1) passes through `on_line`, which may end the header block early."""

    def __init__(self, raw: _DeadlineReader, on_line: Callable[[bytes], bytes]) -> None:
        super().__init__(raw)
        self.on_line = on_line

    def readline(self, size: int = -1) -> bytes:
        line = super().readline(size)
        if not line.endswith(b"\n") and not 0 <= size <= len(line):  # neither a whole line nor one cut at `size`
            raise _NoRequest  # the stream ended mid-header (http.server would take that for the end of the headers)
        return self.on_line(line)


class RewardServer(ThreadingHTTPServer):
    """Serves one reward source, one request per connection (HTTP/1.0). At most `limits.max_connections`
    connections hold a slot (a handler thread); admission closes the oldest pending connection when a newcomer's
    IP is at `limits.max_connections_per_ip` or every slot is taken (module docstring). A newcomer that finds
    every slot trusted is answered 503 at once on a short-lived thread (at most max_connections of those) rather
    than queued; beyond that it is closed unanswered. Scoring is serialised chunk by chunk (one model, one lock):
    `score_chunk` queries per call of the source, 0 for the whole request in one call."""

    request_queue_size = 128  # listen backlog (socketserver's is 5): a burst of connects waits, no SYN is dropped

    def __init__(self, address: tuple[str, int], source: RewardSource, tokenizer=None, *,
                 limits: ServerLimits = ServerLimits(), max_len: int = 2048, score_chunk: int = 0,
                 api_key: str | None = None) -> None:
        self.source, self.tokenizer, self.max_len, self.limits = source, tokenizer, max_len, limits
        self.score_chunk = score_chunk
        self.max_request_bytes = int(limits.max_request_mb * 2**20)
        self.api_key = api_key or None
        self.score_lock = Lock()
        self._lock = Lock()  # guards _connections and their pending/evicted flags
        self._connections: dict[socket.socket, _Connection] = {}  # live handler threads, in accept order
        self._refusal_slots = BoundedSemaphore(limits.max_connections)  # 503 answers in flight (short-lived threads)
        self.num_evicted = 0  # pending connections closed to make room, since start
        super().__init__(address, RewardHandler)

    @property
    def num_connections(self) -> int:
        """Connections holding a slot now (pending or trusted)."""
        with self._lock:
            return sum(not c.evicted for c in self._connections.values())

    @property
    def num_pending(self) -> int:
        """Connections holding a slot whose token (without --api_key: whole request) is not yet in."""
        with self._lock:
            return sum(c.pending and not c.evicted for c in self._connections.values())

    def process_request(self, request: socket.socket, client_address) -> None:
        now = time.monotonic()
        conn = _Connection(request, client_address[0], now, now + self.limits.request_timeout_s)
        admitted, victim = self._admit(conn)
        if victim is not None:
            try:  # wakes its handler's blocked read, which then raises _NoRequest
                victim.sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # its handler has just finished and closed it
                pass
        if admitted:
            try:
                super().process_request(request, client_address)  # starts the handler thread
            except BaseException:
                self._release(request)
                raise
        elif self._refusal_slots.acquire(timeout=_DRAIN_S):  # a burst waits (in the listen backlog) for one
            # answered on its own short-lived thread (its reads and drain bounded by _DRAIN_S): a reply written
            # before the request was read would be lost to a connection reset, and the accept loop must not wait
            # on a client
            try:
                Thread(target=self._refuse, args=(request, client_address), daemon=True).start()
            except BaseException:
                self._refusal_slots.release()
                raise
        else:  # flooded: not even a 503
            self.shutdown_request(request)

    def _admit(self, conn: _Connection) -> tuple[bool, _Connection | None]:
        """Whether `conn` gets a slot, and the slow connection to close: the oldest slow one of its IP when that IP
        is at the per-IP cap, else the oldest slow one of all when every slot is taken (none: no slot, 503)."""
        with self._lock:
            holders = [c for c in self._connections.values() if not c.evicted]
            pending = [c for c in holders if c.pending]
            slow = [c for c in pending if conn.accepted - c.accepted >= self.limits.slow_client_s]
            same_ip = [c for c in slow if c.ip == conn.ip]
            full = len(holders) >= self.limits.max_connections
            at_cap = sum(c.ip == conn.ip for c in pending) >= self.limits.max_connections_per_ip
            victim = same_ip[0] if at_cap and same_ip else slow[0] if full and slow else None
            if victim is None and full:
                return False, None
            if victim is not None:
                victim.evicted = True
                self.num_evicted += 1
            self._connections[conn.sock] = conn
            return True, victim

    def connection(self, sock: socket.socket) -> _Connection:
        with self._lock:
            return self._connections[sock]

    def trust(self, conn: _Connection) -> bool:
        """Mark `conn` trusted (never closed to make room); False if it has been closed for room already."""
        with self._lock:
            if conn.evicted:
                return False
            conn.pending = False
            return True

    def process_request_thread(self, request: socket.socket, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release(request)

    def _refuse(self, request: socket.socket, client_address) -> None:
        try:
            BusyHandler(request, client_address, self)
        except Exception:  # the client went away mid-answer: nothing to tell it
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            self._refusal_slots.release()

    def handle_error(self, request: socket.socket, client_address) -> None:
        """A connection the client reset or left mid-request or mid-answer: one line (an attack of many must not
        fill the log with tracebacks). Anything else is a fault of the server: its traceback."""
        err = sys.exc_info()[1]
        if not isinstance(err, OSError):
            super().handle_error(request, client_address)
            return
        sys.stderr.write(f"serve_rm {client_address[0] if client_address else '?'}: connection ended before its "
                         f"answer: {type(err).__name__}: {err}\n")

    def _release(self, request: socket.socket) -> None:
        with self._lock:
            del self._connections[request]


class RewardHandler(BaseHTTPRequestHandler):
    """One connection: check the token as it arrives, read a bounded body by the deadline, score, answer JSON."""

    server: RewardServer
    default_request_version = "HTTP/1.0"  # a garbled request line still gets a status line (not a bare body)
    _body_unread = False  # an answer sent before the body was read must drain it (see `_drain`)
    _key_seen = _key_ok = False  # the Authorization header line has arrived; it held the server's token

    def setup(self) -> None:
        self.timeout = self.server.limits.request_timeout_s  # for the answer's writes; reads follow the deadline
        super().setup()
        self.rfile.close()  # replaced by one whose reads share the request's deadline
        self.conn = self._connection()
        self.rfile = _RequestReader(_DeadlineReader(self.conn), self._header_line)

    def _connection(self) -> _Connection:
        return self.server.connection(self.request)

    def handle(self) -> None:
        try:
            super().handle()
        except _NoRequest:  # closed mid-headers, by the client or to make room: nobody to answer
            self.close_connection = True

    def _header_line(self, line: bytes) -> bytes:
        """Checks the bearer token the moment its header line arrives. A right one trusts the connection; after a
        wrong one this returns the end of the header block, so the 401 goes out without waiting for the rest."""
        name, colon, value = line.partition(b":")
        if self._key_seen or not colon or self.server.api_key is None or name.strip().lower() != b"authorization":
            return line
        self._key_seen = True
        self._key_ok = hmac.compare_digest(value.strip(), f"Bearer {self.server.api_key}".encode())
        if not self._key_ok:
            return b"\r\n"
        if not self.server.trust(self.conn):
            raise _NoRequest
        return line

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        try:
            self._check_auth()
            inputs = self._parse(self._read_json())
        except RequestError as err:
            self._reply(err.code, {"error": str(err)})
            return
        except TimeoutError:
            self._reply(408, {"error": f"request not received within --request_timeout "
                                       f"{self.server.limits.request_timeout_s}s of connecting"})
            return
        try:
            result = self._score(inputs)
        except RequestError as err:
            self._reply(err.code, {"error": str(err)})
            return
        except ValueError as err:  # the source rejects these samples: retrying cannot help
            self._reply(422, {"error": str(err)})
            return
        except Exception as err:  # any scoring failure must reach the client as an answer, not a dropped socket
            self.log_message("scoring failed:\n%s", traceback.format_exc())
            self._reply(500, {"error": f"scoring failed: {type(err).__name__}: {err} (a fault of the reward "
                                       "source on these samples; retrying the same request fails again)"})
            return
        self._reply(200, {"rewards": result.rewards_B.tolist(), "scores": result.scores_B.tolist(),
                          "extra_logs": {k: v.tolist() for k, v in result.extra_logs.items()}})

    def _not_allowed(self) -> None:
        self._body_unread = True
        self._reply(405, {"error": f"method {self.command} not allowed: POST a JSON body to /get_reward"},
                    {"Allow": "POST"})

    do_GET = do_HEAD = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _not_allowed

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own refusals (a malformed request line or header block, an unknown method), as JSON."""
        self._body_unread = True
        self._reply(int(code), {"error": message or HTTPStatus(code).phrase})

    def _check_auth(self) -> None:
        """After the headers: 401 unless the token's line was right (`_header_line`). Without --api_key the
        connection stays pending until its body is in too (`_read_json`): a slow body is a slow client."""
        if self.server.api_key is not None and not self._key_ok:
            self._body_unread = True
            raise RequestError(401, "missing or wrong 'Authorization: Bearer <key>' header (the server's "
                                    f"--api_key / {API_KEY_ENV}; the trainer sends {API_KEY_ENV})")

    def _read_json(self) -> dict:
        length = self._content_length()
        chunks, received = [], 0
        while received < length:  # each read is bounded by the request's deadline (`_DeadlineReader`)
            chunk = self.rfile.read1(min(length - received, 1 << 20))
            if not chunk:
                raise RequestError(400, f"body ended after {received} of {length} bytes (Content-Length)")
            chunks.append(chunk)
            received += len(chunk)
        if not self.server.trust(self.conn):  # the whole request is in: never closed for room from here
            raise _NoRequest
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
                                    f"{self.server.limits.max_request_mb} MB (--max_request_mb); send smaller batches")
        self._body_unread = False  # from here the body is read (or the read fails and the connection closes)
        return length

    def _parse(self, request: dict) -> RewardInputs:
        queries = request.get("query")
        max_queries = self.server.limits.max_queries
        if isinstance(queries, list) and len(queries) > max_queries:
            raise RequestError(413, f"{len(queries)} queries exceed the server's limit of {max_queries} per "
                                    "request (--max_queries); send smaller batches")
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

    def _score(self, inputs: RewardInputs) -> RewardResult:
        """Scores in chunks of `score_chunk` queries, each under the scoring lock, so other requests' chunks
        interleave; once this request has held the lock past --max_score_s, the rest is refused (413) unscored."""
        server, n = self.server, len(inputs.queries)
        budget_s, size = server.limits.max_score_s, server.score_chunk or max(n, 1)
        parts, spent_s = [], 0.0
        for start in range(0, n, size):
            if spent_s > budget_s:
                raise RequestError(413, f"scoring stopped after {spent_s:.1f}s, past the server's budget of "
                                        f"{budget_s:g}s per request (--max_score_s), with {start} of {n} queries "
                                        "scored; send fewer queries per request (or raise the server's limit)")
            chunk = _rows(inputs, slice(start, start + size))
            with server.score_lock:
                began = time.monotonic()
                try:
                    parts.append(self._score_chunk(chunk))
                except RewardFuncTimeout:  # the call runs on in its thread, without the lock
                    raise RequestError(413, f"reward_func did not return within the server's budget of "
                                            f"{budget_s:g}s per request (--max_score_s) for {n} queries; send "
                                            "fewer queries per request (or raise the server's limit)") from None
                finally:
                    spent_s += time.monotonic() - began
        return _concat(parts)

    def _score_chunk(self, inputs: RewardInputs) -> RewardResult:
        tokenizer = self.server.tokenizer
        if tokenizer is not None:  # under the lock: a fast tokenizer refuses concurrent calls ("Already borrowed")
            enc = tokenizer(inputs.queries, padding=True, truncation=True, max_length=self.server.max_len,
                            return_tensors="pt", add_special_tokens=False)
            inputs.sequences_BT, inputs.attention_mask_BT = enc["input_ids"], enc["attention_mask"]
        return self.server.source.score(inputs)

    def _reply(self, code: int, body: dict, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.connection.settimeout(self.server.limits.request_timeout_s)  # reads may have left a shorter one
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if code >= 400:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        self.wfile.flush()
        if self._body_unread:
            self._drain()

    def _drain(self) -> None:
        """An answer sent before the body was read: stop writing and read (dropping) what the client is
        still sending for a moment, so closing does not reset the connection before it reads the answer."""
        self.conn.deadline = time.monotonic() + min(_DRAIN_S, self.server.limits.request_timeout_s)
        try:
            self.connection.shutdown(socket.SHUT_WR)
            while self.rfile.read1(1 << 16):
                pass
        except OSError:  # includes the deadline (TimeoutError) and _NoRequest: the connection closes either way
            return

    def log_request(self, code="-", size="-") -> None:  # quiet for answered requests
        return

    def log_message(self, format: str, *args) -> None:  # errors and timeouts; never headers (the token)
        sys.stderr.write(f"serve_rm {self.address_string()}: {format % args}\n")


class BusyHandler(RewardHandler):
    """A connection with no slot: answers 503 to whatever request arrives within a second."""

    def _connection(self) -> _Connection:  # not in the server's table: it holds no slot and is never evicted
        now = time.monotonic()
        return _Connection(self.request, "", now, now + min(_DRAIN_S, self.server.limits.request_timeout_s))

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        self._body_unread = True
        self._reply(503, {"error": f"reward server busy: all {self.server.limits.max_connections} connections "
                                   "(--max_connections) are in use; retry later"})


def _rows(inputs: RewardInputs, rows: slice) -> RewardInputs:
    return RewardInputs(inputs.queries[rows], inputs.prompts[rows], inputs.labels[rows], inputs.sequences_BT[rows],
                        inputs.attention_mask_BT[rows])


def _concat(parts: list[RewardResult]) -> RewardResult:
    """One result from the chunks' results, in order (no parts: an empty result)."""
    if len(parts) == 1:
        return parts[0]
    if not parts:
        return RewardResult(torch.zeros(0), torch.zeros(0))
    return RewardResult(torch.cat([p.rewards_B for p in parts]), torch.cat([p.scores_B for p in parts]),
                        {k: torch.cat([p.extra_logs[k] for p in parts]) for k in parts[0].extra_logs},
                        frozenset().union(*(p.per_call for p in parts)))
