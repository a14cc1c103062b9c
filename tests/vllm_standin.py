"""A stand-in for `VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --worker-extension-cls rloo_multinode.VLLMWorkerExtension`,
for tests on machines without vLLM or a GPU. It speaks the part of vLLM 0.10.2's HTTP server that rloo_multinode.py
uses (GET /health and /v1/models; POST /v1/completions with token-id prompts and return_token_ids, /collective_rpc
and /reset_prefix_cache) and runs the project's own VLLMWorkerExtension in its workers, on a transformers model:
the trainer's side and the worker extension are the code under test, not this file. test_vllm_api_of_the_pinned_release
checks the request fields against vLLM's own request model where vLLM is installed.

    python tests/vllm_standin.py --model PATH --port PORT [--workers 2] [--no-dev_mode] --log LOG.jsonl

Each request is logged (path and body) to --log; after every /reset_prefix_cache (the end of a
weight sync) every worker's weights are saved to --log with the suffix .pt, as a list.
"""

import json
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import torch
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import rloo  # noqa: E402
import rloo_multinode as mn  # noqa: E402

# the completions fields rloo_multinode.py sends, all of them fields of vLLM 0.10.2's CompletionRequest
COMPLETIONS_FIELDS = {"model", "prompt", "n", "return_token_ids", "temperature", "top_p", "top_k", "min_p",
                      "repetition_penalty", "max_tokens", "stop_token_ids", "ignore_eos"}


@dataclass
class StandInArgs:
    model: str
    port: int
    log: Path
    workers: int = 1
    """workers per server, each with a whole copy of the model (vLLM would shard it for tensor parallelism)"""
    dev_mode: bool = True
    """False: no /collective_rpc or /reset_prefix_cache, as `vllm serve` without VLLM_SERVER_DEV_MODE=1"""
    seed: int = 0


class Loader:
    """The worker's model_runner.model: load_weights(weights=[(name, tensor)]) as vLLM's models have it."""

    def __init__(self, model):
        self.model, self.params = model, dict(model.named_parameters())

    def load_weights(self, weights) -> set[str]:
        for name, tensor in weights:
            self.params[name].data.copy_(tensor)
        return {name for name, _ in weights}


class Worker(mn.VLLMWorkerExtension):
    def __init__(self, model, rank: int):
        self.rank = rank
        self.model_runner = SimpleNamespace(device=torch.device("cpu"), model=Loader(model))


class StandIn:
    def __init__(self, args: StandInArgs):
        self.args, self.lock = args, threading.Lock()
        load = lambda: rloo.load_causal_lm(args.model, torch.float32, False).eval().requires_grad_(False)  # noqa: E731
        self.workers = [Worker(load(), rank) for rank in range(args.workers)]
        self.pool = ThreadPoolExecutor(args.workers)  # a collective_rpc runs on every worker at once
        self.generator = torch.Generator().manual_seed(args.seed)

    def log(self, path: str, body: dict) -> None:
        with self.lock, open(self.args.log, "a") as f:
            f.write(json.dumps({"path": path, "body": body}) + "\n")

    def complete(self, body: dict) -> dict:
        unknown = set(body) - COMPLETIONS_FIELDS
        if unknown:
            raise ValueError(f"fields this stand-in does not know: {sorted(unknown)}")
        if not (body["ignore_eos"] and body["top_k"] == 0 and body["top_p"] == 1.0 and body["n"] == 1):
            raise ValueError("rloo_multinode.py samples with ignore_eos, no top-k/top-p, n=1")
        prompts, length = body["prompt"], body["max_tokens"]
        width = max(map(len, prompts))
        queries = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # (N, Tq), left-padded
        mask = torch.tensor([[False] * (width - len(p)) + [True] * len(p) for p in prompts])
        stop = body["stop_token_ids"][0] if body["stop_token_ids"] else None
        with self.lock:
            tokens = rloo.generate(self.workers[0].model_runner.model.model, queries, mask, length,
                                   body["temperature"], stop, 0, self.generator)  # (N, length)
        choices = []
        for i, row in enumerate(tokens.tolist()):
            end = row.index(stop) + 1 if stop is not None and stop in row else length  # vLLM stops at the stop token
            choices.append({"index": i, "text": "", "token_ids": row[:end],
                            "finish_reason": "stop" if end < length or row[-1] == stop else "length"})
        return {"id": "cmpl-standin", "object": "text_completion", "model": body["model"], "choices": choices}

    def collective_rpc(self, body: dict) -> dict:
        calls = [self.pool.submit(getattr(w, body["method"]), *body.get("args", []), **body.get("kwargs", {}))
                 for w in self.workers]
        results = [call.result() for call in calls]
        return {"results": [r if r is None or isinstance(r, (dict, list)) else str(r) for r in results]}

    def reset_prefix_cache(self, body: dict) -> None:
        torch.save([w.model_runner.model.model.state_dict() for w in self.workers], self.args.log.with_suffix(".pt"))


def handler(standin: StandIn):
    class Handler(BaseHTTPRequestHandler):
        def answer(self, code: int, content=None) -> None:
            data = b"" if content is None else json.dumps(content).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                return self.answer(200)
            if self.path == "/v1/models":
                return self.answer(200, {"object": "list", "data": [{"id": standin.args.model, "object": "model"}]})
            self.answer(404, {"detail": "Not Found"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
            path = self.path.split("?")[0]
            routes = {"/v1/completions": standin.complete}
            if standin.args.dev_mode:
                routes |= {"/collective_rpc": standin.collective_rpc, "/reset_prefix_cache": standin.reset_prefix_cache}
            if path not in routes:
                return self.answer(404, {"detail": "Not Found"})
            standin.log(path, body)
            try:
                self.answer(200, routes[path](body))
            except Exception as e:  # vLLM answers a bad request with 400 and a message
                self.answer(400, {"error": {"message": f"{type(e).__name__}: {e}"}})

        def log_message(self, *args):
            pass

    return Handler


if __name__ == "__main__":
    args = tyro.cli(StandInArgs)
    ThreadingHTTPServer(("127.0.0.1", args.port), handler(StandIn(args))).serve_forever()
