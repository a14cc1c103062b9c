"""A stand-in for `VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config '{"backend": "gloo"}'`, for what a
real server cannot show on a 2-core CPU machine: several workers per server (tensor parallelism) and several servers
at once. It speaks the part of vLLM 0.32's HTTP server that rloo_multinode.py uses (GET /health, /v1/models,
/get_world_size and /server_info; POST /v1/completions with token-id prompts and return_token_ids, the weight-transfer
routes /init_weight_transfer_engine, /start_weight_update, /update_weights, /finish_weight_update and
/shutdown_weight_transfer_engine, and /reset_prefix_cache; with --runtime_lora /v1/load_lora_adapter and
/v1/unload_lora_adapter, which check the adapter's files and record its name, sampling on from the base), and its workers receive weights with the project's own
GlooWeightReceiver (the receiving end of its gloo backend) into transformers models: the trainer's side and the
receiver are the code under test, not this file. tests/test_vllm.py attaches the trainer to a real server, which
answers every one of these routes.

    python tests/vllm_standin.py --model PATH --port PORT [--workers 2] [--no-dev_mode] --log LOG.jsonl

Each request is logged (path and body) to --log; after every /reset_prefix_cache (the end of a
weight sync) every worker's weights are saved to --log with the suffix .pt, as a list. It can also misbehave as a
server may, for the trainer's checks: answer completions wrongly (--bad_answer, one of BAD_ANSWERS), report another
world size (POST /standin/set {"bad_answer": ..., "world_size_answer": ...} changes them), fail or never complete
the weight group's set-up, die or stall in the middle of a sync or an adapter's load.
"""

import json
import os
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable, Optional

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
LORA_ROUTES = {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"}  # with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 only
POST_ROUTES = LORA_ROUTES | {"/v1/completions", "/init_weight_transfer_engine", "/start_weight_update",
                             "/update_weights", "/finish_weight_update", "/shutdown_weight_transfer_engine",
                             "/reset_prefix_cache", "/standin/set"}


def set_logprob(value) -> Callable[[dict, Optional[int], int], None]:
    return lambda a, stop, vocab: a["choices"][0]["logprobs"]["token_logprobs"].__setitem__(0, value)


def set_token(value) -> Callable[[dict, Optional[int], int], None]:
    return lambda a, stop, vocab: a["choices"][0]["token_ids"].__setitem__(0, value(vocab) if callable(value)
                                                                            else value)


def set_index(value) -> Callable[[dict, Optional[int], int], None]:
    return lambda a, stop, vocab: a["choices"][0].__setitem__("index", value)


def cut(choice: dict, tokens: list[int]) -> None:
    choice["token_ids"], choice["logprobs"]["token_logprobs"] = tokens, [-1.0] * len(tokens)


# What an engine may send that is not what it was asked for: each makes a good answer (an OpenAI completions answer,
# {"choices": [{"index", "token_ids", "logprobs": {"token_logprobs"}}, ...]}, the form every engine of
# rloo_multinode.py answers in) wrong in one way, in place, given the stop token and the vocabulary's size. This
# stand-in sends them (--bad_answer), and so does a served engine in the tests (tests/faulty_engines.py)
BAD_ANSWERS: dict[str, Callable[[dict, Optional[int], int], None]] = {
    "one_choice_fewer": lambda a, stop, vocab: a["choices"].pop(),
    "one_choice_more": lambda a, stop, vocab: a["choices"].append(a["choices"][0] | {"index": len(a["choices"])}),
    "no_choices": lambda a, stop, vocab: a.pop("choices"),
    "choices_not_a_list": lambda a, stop, vocab: a.__setitem__("choices", {"0": a["choices"][0]}),
    "choice_not_an_object": lambda a, stop, vocab: a["choices"].__setitem__(0, [0]),
    "duplicate_index": lambda a, stop, vocab: a["choices"][1].__setitem__("index", a["choices"][0]["index"]),
    "index_out_of_range": set_index(10**6), "negative_index": set_index(-1), "index_as_text": set_index("0"),
    "index_as_float": set_index(0.0), "index_as_bool": set_index(False), "no_index": set_index(None),
    "float_token_id": set_token(2.0), "token_id_as_text": set_token("2"), "token_id_as_bool": set_token(True),
    "null_token_id": set_token(None), "token_id_as_list": set_token([2]), "token_id_of_a_million": set_token(10**6),
    "negative_token_id": set_token(-5), "token_id_beyond_int64": set_token(2**70),
    "token_id_of_the_vocabulary_size": set_token(lambda vocab: vocab),
    "token_ids_as_text": lambda a, stop, vocab: a["choices"][0].__setitem__("token_ids", "ab"),
    "more_tokens_than_asked": lambda a, stop, vocab: cut(a["choices"][0], [2] * 64),
    "fewer_tokens_without_the_stop_token": lambda a, stop, vocab: cut(a["choices"][0], [2]),
    "no_tokens": lambda a, stop, vocab: cut(a["choices"][0], []),
    "tokens_after_the_stop_token": lambda a, stop, vocab: cut(a["choices"][0], [stop, 2]),
    "nan_logprob": set_logprob(float("nan")), "logprob_of_plus_50": set_logprob(50.0),
    "tiny_positive_logprob": set_logprob(1e-30), "infinite_logprob": set_logprob(float("inf")),
    "minus_infinite_logprob": set_logprob(float("-inf")), "logprob_beyond_float32": set_logprob(-1e300),
    "logprob_as_text": set_logprob("-0.5"), "null_logprob": set_logprob(None), "logprob_as_bool": set_logprob(False),
    "one_logprob_fewer": lambda a, stop, vocab: a["choices"][0]["logprobs"]["token_logprobs"].pop(),
    "no_logprobs": lambda a, stop, vocab: a["choices"][0].__setitem__("logprobs", None),
}


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
    bad_answer: Optional[str] = None
    """a case of BAD_ANSWERS: completions answered wrongly in that way ..."""
    bad_from: int = 1
    """... from this completions request on (the first is 1)"""
    world_size_answer: Optional[str] = None
    """the JSON that /get_world_size reports as the world size (None: the workers')"""
    fail_init: bool = False
    """/init_weight_transfer_engine fails (500), as vLLM's does when its workers cannot join the group"""
    join: bool = True
    """False: /init_weight_transfer_engine answers at once and no worker ever joins the weight group"""
    die_at_sync: int = 0
    """the process kills itself with SIGKILL once its workers took the first bucket of this /update_weights (1: the
    first; 0: never)"""
    stall_at_sync: int = 0
    """... or its workers stop receiving there, forever, the server answering everything else"""
    max_lora_rank: int = 0
    """what /server_info reports as its --max-lora-rank (0: started without --enable-lora)"""
    runtime_lora: bool = False
    """as with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 in its environment: the LoRA routes answer, /server_info says so"""
    stall_at_adapter: int = 0
    """its n-th /v1/load_lora_adapter never answers (0: none), the server answering everything else"""


class Worker:
    def __init__(self, model, rank: int, args: StandInArgs):
        self.model, self.rank, self.receiver, self.args = model, rank, None, args
        self.params = dict(model.named_parameters())
        self.updates = 0  # update_weights calls

    def init_weight_transfer_engine(self, info: dict) -> None:
        if self.args.fail_init:
            raise RuntimeError("the stand-in's workers cannot join the weight group")
        if self.args.join:
            self.receiver = mn.GlooWeightReceiver(info, int(info["rank_offset"]) + self.rank)

    @torch.no_grad()
    def load_weights(self, weights) -> None:
        for name, tensor in weights:
            self.params[name].copy_(tensor)
        if self.updates == self.args.die_at_sync:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.updates == self.args.stall_at_sync:
            threading.Event().wait()

    def update_weights(self, info: dict) -> None:
        self.updates += 1
        self.receiver.receive(info, self.load_weights)


class StandIn:
    def __init__(self, args: StandInArgs):
        self.args, self.lock = args, threading.Lock()
        load = lambda: plumbing.load_causal_lm(args.model, torch.float32, False).eval().requires_grad_(False)  # noqa: E731
        self.workers = [Worker(load(), rank, args) for rank in range(args.workers)]
        self.pool = ThreadPoolExecutor(args.workers)  # vLLM runs each call on every worker at once
        self.generator = torch.Generator().manual_seed(args.seed)
        self.updating = False
        self.completions = 0  # completions requests answered
        self.adapters_loaded = 0  # /v1/load_lora_adapter calls

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
            reported = self.args.world_size_answer
            return {"world_size": self.args.workers if reported is None else json.loads(reported)}
        backend, lora_rank = self.args.weight_transfer, self.args.max_lora_rank
        return {"vllm_config": {"weight_transfer_config": backend and {"backend": backend},  # /server_info
                                "model_config": {"max_model_len": self.args.max_model_len,
                                                 "logprobs_mode": self.args.logprobs_mode},
                                "lora_config": lora_rank and {"max_lora_rank": lora_rank}},
                "vllm_env": {mn.RUNTIME_LORA: "1"} if self.args.runtime_lora else {}}

    def post(self, path: str, body: dict):
        if path == "/v1/completions":
            answer = self.complete(body)
            self.completions += 1
            if self.args.bad_answer is not None and self.completions >= self.args.bad_from:
                stop = body["stop_token_ids"][0] if body["stop_token_ids"] else None
                BAD_ANSWERS[self.args.bad_answer](answer, stop, self.workers[0].model.config.vocab_size)
            return answer
        if path == "/standin/set":  # the stand-in's own: its flags changed (a bad answer from the next request on)
            for name, value in body.items():
                setattr(self.args, name, value)
            self.args.bad_from = self.completions + 1 if "bad_answer" in body else self.args.bad_from
            return {}
        if path == "/v1/load_lora_adapter":
            self.adapters_loaded += 1
            if self.adapters_loaded == self.args.stall_at_adapter:
                threading.Event().wait()
            for name in (plumbing.ADAPTER_CONFIG, plumbing.ADAPTER_WEIGHTS):
                if not (Path(body["lora_path"]) / name).is_file():
                    raise FileNotFoundError(f"no {name} in {body['lora_path']}")
        elif path == "/init_weight_transfer_engine":
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
            routes = all_routes if standin.args.dev_mode else \
                all_routes & {"/health", "/v1/models", "/v1/completions", *LORA_ROUTES}
            return routes if standin.args.runtime_lora else routes - LORA_ROUTES

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
