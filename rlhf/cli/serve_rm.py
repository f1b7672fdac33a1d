"""A small HTTP reward server: `python -m rlhf.cli.serve_rm --reward_pretrain DIR[,DIR] --port 5000`
or `--remote_rm_url reward.py`. Answers POST /get_reward with {"rewards": [...]} for
{"query": [...], "prompts": [...], "labels": [...]} (what `--remote_rm_url http://host:port/get_reward`
sends). Single process, CPU or one GPU; for tests and small deployments."""

from __future__ import annotations

import argparse
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from threading import Lock

import torch

from rlhf.rewards.base import RewardInputs, RewardSource


def build_source(args: argparse.Namespace) -> tuple[RewardSource, object | None]:
    if args.remote_rm_url:
        from rlhf.rewards.reward_func import RewardFuncFile

        return RewardFuncFile(args.remote_rm_url), None
    from rlhf.models.loading import load_tokenizer
    from rlhf.models.micro_batches import MicroBatcher
    from rlhf.models.value import load_scalar_head_model
    from rlhf.rewards.models import RewardModelEnsemble

    paths = [p for p in args.reward_pretrain.split(",") if p]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    models = [load_scalar_head_model(p, args.value_head_prefix, dtype, "sdpa").to(device).eval() for p in paths]
    return RewardModelEnsemble(models, device, MicroBatcher(args.batch_size)), load_tokenizer(paths[0])


def make_handler(source: RewardSource, tokenizer, max_len: int):
    lock = Lock()

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:  # noqa: N802 - http.server's naming
            try:
                request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                queries = request["query"]
            except (ValueError, KeyError, TypeError) as err:
                self._reply(400, {"error": f"expected JSON with 'query' (and 'prompts', 'labels'): {err}"})
                return
            if not queries:
                self._reply(200, {"rewards": [], "scores": [], "extra_logs": {}})
                return
            prompts = request.get("prompts") or [""] * len(queries)
            labels = request.get("labels") or [None] * len(queries)
            ids = mask = torch.zeros(len(queries), 1, dtype=torch.long)
            if tokenizer is not None:
                enc = tokenizer(queries, padding=True, truncation=True, max_length=max_len, return_tensors="pt",
                                add_special_tokens=False)
                ids, mask = enc["input_ids"], enc["attention_mask"]
            try:
                with lock:
                    result = source.score(RewardInputs(queries, prompts, labels, ids, mask))
            except ValueError as err:
                self._reply(422, {"error": str(err)})
                return
            except RuntimeError as err:  # e.g. a model failure: the client may retry
                self._reply(500, {"error": str(err)})
                return
            self._reply(200, {"rewards": result.rewards_B.tolist(), "scores": result.scores_B.tolist(),
                              "extra_logs": {k: v.tolist() for k, v in result.extra_logs.items()}})

        def log_message(self, format: str, *args) -> None:  # quiet by default
            return

    return Handler


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rlhf.cli.serve_rm", description=__doc__)
    parser.add_argument("--reward_pretrain", default=None, help="reward model directories, comma separated")
    parser.add_argument("--remote_rm_url", default=None, help="a .py file defining reward_func instead")
    parser.add_argument("--value_head_prefix", default="score")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--max_len", type=int, default=4096)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=5000)
    args = parser.parse_args(argv)
    if bool(args.reward_pretrain) == bool(args.remote_rm_url):
        parser.error("give exactly one of --reward_pretrain or --remote_rm_url")
    try:
        source, tokenizer = build_source(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    server = ThreadingHTTPServer((args.host, args.port), make_handler(source, tokenizer, args.max_len))
    print(f"serving rewards on http://{args.host}:{server.server_address[1]}/get_reward", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
