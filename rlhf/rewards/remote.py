"""Rewards from an HTTP reward server (OpenRLHF's remote RM protocol), with timeouts and retries.

Request: POST JSON {"query": [...], "prompts": [...], "labels": [...]}. Response: JSON with
"rewards" (and optionally "scores", "extra_logs"), or a bare list of rewards. A server that requires a
bearer token (`serve_rm --api_key`) gets the one in env RLHF_RM_API_KEY: the key is read from the
environment, never from a flag, so it stays out of the logged config and the process list.
"""

from __future__ import annotations

import http.client
import json
import os
import time
import urllib.error
import urllib.request

from rlhf.rewards.base import RewardInputs, RewardResult, result_from_output

API_KEY_ENV = "RLHF_RM_API_KEY"
# what the same request can pass on a later try: the server (or a proxy before it) was slow, busy or unreachable.
# Not a 500: serve_rm answers 500 for a fault of its reward source on these samples, which a retry hits again.
_RETRIED_HTTP = (408, 429, 502, 503, 504)
BACKOFF_S = 0.5
"""The first sleep between two tries; each later one doubles, up to MAX_BACKOFF_S."""
MAX_BACKOFF_S = 2.0
"""The longest sleep between two tries: a server that comes back (a restart takes seconds to a minute) is reached
within this of its return, not after a doubled sleep that can outlast the other ranks' --dist_timeout."""


def backoff_schedule(backoff_s: float, retries: int) -> list[float]:
    """The sleeps between `retries` tries: backoff_s doubling, each at most MAX_BACKOFF_S."""
    return [min(backoff_s * 2**attempt, MAX_BACKOFF_S) for attempt in range(retries - 1)]


def retry_sleeps_s(retries: int, backoff_s: float = BACKOFF_S) -> float:
    """How long a client of `retries` tries sleeps in all when every try fails at once (a server that is down)."""
    return sum(backoff_schedule(backoff_s, retries))


class RemoteRewardClient:
    """A `RewardSource` that posts each batch to `url`. Failures a retry can pass (connection errors, timeouts,
    truncated or garbled answers, HTTP 408, 429, 502, 503, 504) are retried after sleeps of backoff_s doubling
    up to MAX_BACKOFF_S (`backoff_schedule`); any other HTTP error
    raises at once: ValueError for a 4xx (the request's fault), RuntimeError for a 5xx such as serve_rm's 500.
    `api_key` (default: env RLHF_RM_API_KEY) is sent as `Authorization: Bearer <key>`."""

    def __init__(self, url: str, timeout_s: float = 30.0, retries: int = 3, backoff_s: float = BACKOFF_S,
                 api_key: str | None = None) -> None:
        self.url, self.timeout_s, self.retries, self.backoff_s = url, timeout_s, retries, backoff_s
        self._api_key = api_key or os.environ.get(API_KEY_ENV) or None

    def _post(self, payload: bytes):
        headers = {"Content-Type": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        request = urllib.request.Request(self.url, data=payload, headers=headers)
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            return json.loads(response.read().decode("utf-8"))

    def score(self, batch: RewardInputs) -> RewardResult:
        payload = json.dumps({"query": batch.queries, "prompts": batch.prompts, "labels": batch.labels}).encode()
        last_error, sleeps = "", backoff_schedule(self.backoff_s, self.retries)
        for attempt in range(self.retries):
            try:
                out = self._post(payload)
            except urllib.error.HTTPError as err:
                detail = f"HTTP {err.code}: {_error_text(err)}"
                if err.code not in _RETRIED_HTTP:  # the same request fails again
                    raise self._refused(err.code, detail) from err
                last_error = detail
            except (OSError, http.client.HTTPException, json.JSONDecodeError, UnicodeDecodeError) as err:
                # OSError: refused/reset/timed out; HTTPException: truncated (IncompleteRead) or no answer
                last_error = f"{type(err).__name__}: {err}"
            else:
                return result_from_output(out, len(batch.queries), f"reward server {self.url}")
            if attempt < len(sleeps):
                time.sleep(sleeps[attempt])
        raise RuntimeError(f"reward server {self.url} failed {self.retries} times (timeout {self.timeout_s}s); "
                           f"last error: {last_error}")

    def _refused(self, code: int, detail: str) -> Exception:
        if code >= 500:
            return RuntimeError(f"reward server {self.url} answered {detail} (a server error that the same request "
                                "meets again: not retried)")
        hint = f" (set {API_KEY_ENV} to the server's key)" if code == 401 else ""
        return ValueError(f"reward server {self.url} answered {detail}{hint}")


def _error_text(err: urllib.error.HTTPError) -> str:
    """The server's explanation: the "error" field of a JSON body, else the start of the body."""
    try:
        body = err.read(2000).decode("utf-8", errors="replace")
    except (OSError, http.client.HTTPException):
        return err.reason or "(no body)"
    try:
        parsed = json.loads(body)
    except ValueError:
        return body[:500] or str(err.reason)
    return str(parsed["error"]) if isinstance(parsed, dict) and "error" in parsed else body[:500]
