"""A stand-in for `VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config '{"backend": "gloo"}'`, for what a
real server cannot show on a 2-core CPU machine: several workers per server (tensor parallelism) and several servers
at once. It speaks the part of vLLM 0.32's HTTP server that rloo_multinode.py uses (GET /health, /v1/models,
/get_world_size and /server_info; POST /v1/completions with token-id prompts and return_token_ids, the weight-transfer
routes /init_weight_transfer_engine, /start_weight_update, /update_weights, /finish_weight_update and
/shutdown_weight_transfer_engine, and /reset_prefix_cache), and its workers receive weights with the project's own
GlooWeightReceiver (the receiving end of its gloo backend) into transformers models: the trainer's side and the
receiver are the code under test, not this file. tests/test_vllm.py attaches the trainer to a real server, which
answers every one of these routes.

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
from typing import Optional

import torch
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import plumbing
import rloo  # noqa: E402
import rloo_multinode as mn  # noqa: E402

# the completions fields rloo_multinode.py sends, all of them fields of vLLM 0.32's CompletionRequest
COMPLETIONS_FIELDS = {"model", "prompt", "n", "return_token_ids", "temperature", "top_p", "top_k", "min_p",
                      "repetition_penalty", "max_tokens", "stop_token_ids", "ignore_eos", "logprobs"}
GET_ROUTES = {"/health", "/v1/models", "/get_world_size", "/server_info"}
POST_ROUTES = {"/v1/completions", "/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
               "/finish_weight_update", "/shutdown_weight_transfer_engine", "/reset_prefix_cache"}


@dataclass
class StandInArgs:
    model: str
    port: int
    log: Path
    workers: int = 1
    """workers per server, each with a whole copy of the model (vLLM would shard it for tensor parallelism)"""
    dev_mode: bool = True
    """False: none of the development routes, as `vllm serve` without VLLM_SERVER_DEV_MODE=1"""
    weight_transfer: Optional[str] = "gloo"
    """the weight-transfer backend /server_info reports (None: started without --weight-transfer-config)"""
    max_model_len: int = 64
    logprobs_mode: str = "processed_logprobs"
    """what /server_info reports as the server's --logprobs-mode"""
    seed: int = 0


class Worker:
    def __init__(self, model, rank: int):
        self.model, self.rank, self.receiver = model, rank, None
        self.params = dict(model.named_parameters())

    def init_weight_transfer_engine(self, info: dict) -> None:
        self.receiver = mn.GlooWeightReceiver(info, int(info["rank_offset"]) + self.rank)

    @torch.no_grad()
    def load_weights(self, weights) -> None:
        for name, tensor in weights:
            self.params[name].copy_(tensor)

    def update_weights(self, info: dict) -> None:
        self.receiver.receive(info, self.load_weights)


class StandIn:
    def __init__(self, args: StandInArgs):
        self.args, self.lock = args, threading.Lock()
        load = lambda: plumbing.load_causal_lm(args.model, torch.float32, False).eval().requires_grad_(False)  # noqa: E731
        self.workers = [Worker(load(), rank) for rank in range(args.workers)]
        self.pool = ThreadPoolExecutor(args.workers)  # vLLM runs each call on every worker at once
        self.generator = torch.Generator().manual_seed(args.seed)
        self.updating = False

    def log(self, path: str, body: dict) -> None:
        with self.lock, open(self.args.log, "a") as f:
            f.write(json.dumps({"path": path, "body": body}) + "\n")

    def on_workers(self, method: str, *args) -> None:
        for call in [self.pool.submit(getattr(w, method), *args) for w in self.workers]:
            call.result()

    def get(self, path: str):
        if path == "/health":
            return None
        if path == "/v1/models":
            return {"object": "list", "data": [{"id": self.args.model, "object": "model"}]}
        if path == "/get_world_size":
            return {"world_size": self.args.workers}
        backend = self.args.weight_transfer
        return {"vllm_config": {"weight_transfer_config": backend and {"backend": backend},  # /server_info
                                "model_config": {"max_model_len": self.args.max_model_len,
                                                 "logprobs_mode": self.args.logprobs_mode}}}

    def post(self, path: str, body: dict):
        if path == "/v1/completions":
            return self.complete(body)
        if path == "/init_weight_transfer_engine":
            self.on_workers("init_weight_transfer_engine", body["init_info"])
        elif path == "/start_weight_update":
            if self.updating:
                raise RuntimeError("start_weight_update called while a weight update is already active")
            self.updating = True
        elif path == "/update_weights":
            if not self.updating:
                raise RuntimeError("start_weight_update must be called before update_weights")
            self.on_workers("update_weights", body["update_info"])
        elif path == "/finish_weight_update":
            self.updating = False
        elif path == "/reset_prefix_cache":
            torch.save([w.model.state_dict() for w in self.workers], self.args.log.with_suffix(".pt"))
        return {}

    def complete(self, body: dict) -> dict:
        unknown = set(body) - COMPLETIONS_FIELDS
        if unknown:
            raise ValueError(f"fields this stand-in does not know: {sorted(unknown)}")
        if not (body["ignore_eos"] and body["n"] == 1):
            raise ValueError("rloo_multinode.py samples with ignore_eos, n=1")
        filters = rloo.SamplingFilters(body["top_k"], body["top_p"], body["min_p"] or None,
                                       body["repetition_penalty"])  # vLLM's meanings are rloo.py's
        prompts, length = body["prompt"], body["max_tokens"]
        width = max(map(len, prompts))
        queries = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # (N, Tq), left-padded
        mask = torch.tensor([[False] * (width - len(p)) + [True] * len(p) for p in prompts])
        stop = body["stop_token_ids"][0] if body["stop_token_ids"] else None
        logprobs = torch.zeros(len(prompts), length)  # (N, length) the sampled tokens' (processed_logprobs)
        with self.lock:
            tokens = rloo.generate(self.workers[0].model, queries, mask, length, body["temperature"], stop, 0,
                                   self.generator, logprobs_out=logprobs, filters=filters)  # (N, length)
        choices = []
        for i, (row, row_logprobs) in enumerate(zip(tokens.tolist(), logprobs.tolist())):
            end = row.index(stop) + 1 if stop is not None and stop in row else length  # vLLM stops at the stop token
            choices.append({"index": i, "text": "", "token_ids": row[:end],
                            "finish_reason": "stop" if end < length or row[-1] == stop else "length"})
            if body.get("logprobs") is not None:  # vLLM's CompletionLogProbs
                choices[-1]["logprobs"] = {"token_logprobs": row_logprobs[:end], "tokens": [""] * end,
                                           "top_logprobs": [{}] * end, "text_offset": [0] * end}
        return {"id": "cmpl-standin", "object": "text_completion", "model": body["model"], "choices": choices}


def handler(standin: StandIn):
    class Handler(BaseHTTPRequestHandler):
        def answer(self, code: int, content=None) -> None:
            data = b"" if content is None else json.dumps(content).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def routes(self, all_routes: set) -> set:
            return all_routes if standin.args.dev_mode else all_routes & {"/health", "/v1/models", "/v1/completions"}

        def do_GET(self):
            path = self.path.split("?")[0]
            if path not in self.routes(GET_ROUTES):
                return self.answer(404, {"detail": "Not Found"})
            self.answer(200, standin.get(path))

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
            path = self.path.split("?")[0]
            if path not in self.routes(POST_ROUTES):
                return self.answer(404, {"detail": "Not Found"})
            standin.log(path, body)
            try:
                self.answer(200, standin.post(path, body))
            except Exception as e:  # vLLM answers a failed call with an error status and a message
                self.answer(500, {"error": {"message": f"{type(e).__name__}: {e}"}})

        def log_message(self, *args):
            pass

    return Handler


if __name__ == "__main__":
    args = tyro.cli(StandInArgs)
    ThreadingHTTPServer(("127.0.0.1", args.port), handler(StandIn(args))).serve_forever()
