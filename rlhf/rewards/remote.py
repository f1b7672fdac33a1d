"""Rewards from an HTTP reward server (OpenRLHF's remote RM protocol), with timeouts and retries.

Request: POST JSON {"query": [...], "prompts": [...], "labels": [...]}. Response: JSON with
"rewards" (and optionally "scores", "extra_logs"), or a bare list of rewards.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from rlhf.rewards.base import RewardInputs, RewardResult, result_from_output


class RemoteRewardClient:
    """A `RewardSource` that posts each batch to `url`; transient failures are retried with backoff."""

    def __init__(self, url: str, timeout_s: float = 30.0, retries: int = 3, backoff_s: float = 0.5) -> None:
        self.url, self.timeout_s, self.retries, self.backoff_s = url, timeout_s, retries, backoff_s

    def _post(self, payload: bytes):
        request = urllib.request.Request(self.url, data=payload, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            return json.loads(response.read().decode("utf-8"))

    def score(self, batch: RewardInputs) -> RewardResult:
        payload = json.dumps({"query": batch.queries, "prompts": batch.prompts, "labels": batch.labels}).encode()
        last_error: Exception | None = None
        for attempt in range(self.retries):
            try:
                out = self._post(payload)
                return result_from_output(out, len(batch.queries), f"reward server {self.url}")
            except urllib.error.HTTPError as err:
                if err.code < 500:  # the server rejected the request: retrying cannot help
                    raise ValueError(f"reward server {self.url} answered HTTP {err.code}: "
                                     f"{err.read()[:300].decode(errors='replace')}") from err
                last_error = err
            except (urllib.error.URLError, TimeoutError, ConnectionError, json.JSONDecodeError) as err:
                last_error = err
            time.sleep(self.backoff_s * 2**attempt)
        raise RuntimeError(f"reward server {self.url} failed {self.retries} times (timeout {self.timeout_s}s); "
                           f"last error: {last_error}")
