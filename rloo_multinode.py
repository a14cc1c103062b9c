"""RLOO with generation on separate engines: rloo.py's algorithm, unchanged, on the training ranks; sampling on
vLLM engines (or transformers engines, `--engine hf`) on other GPUs or nodes; after every update the trainer's
rank 0 broadcasts the new weights to every engine.

    # one node: 6 training GPUs, engines on GPUs 6 and 7, started by the script
    torchrun --nproc_per_node 6 rloo_multinode.py --num_engines 2 --engine_devices 6,7 [rloo.py flags]
    # engines on other nodes: start them there (they wait for the trainer), then the trainer
    python rloo_multinode.py serve --trainer_address TRAINER_HOST:29600 --engine_index 0
    torchrun ... rloo_multinode.py --num_engines 1 --no-launch_engines [rloo.py flags]

What this file adds to rloo.py, nothing else: engine start-up, prompt dispatch and weight sync.
  - Control: a TCPStore served by trainer rank 0 at MASTER_ADDR:--engine_port. Rank 0 writes one ordered command
    stream (`generate`, `sync`, `stop`) that every engine follows; rank r writes its queries and reads its
    completions under keys of its own. Engine r % num_engines serves rank r.
  - Weights: one process group of trainer rank 0 and every engine worker (gloo for the hf engine, NCCL through
    vLLM's PyNcclCommunicator for vLLM), packed buckets cast to the engine's dtype.
  - The trainer recomputes every log-prob it trains on (never the engine's), so the PPO ratio is exact.
  - --async_generation: the engines sample batch t+1 with the weights of update t-1 while the trainer trains on
    batch t (one step off-policy); the log-probs of the weights that sampled are recomputed by the trainer from a
    copy it keeps.

Sections: Args | weight buckets | weight groups | engines | trainer side | launching | main.
"""

import contextlib
import copy
import datetime
import io
import itertools
import json
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar, Literal, Optional

import torch
import torch.distributed as dist
import tyro
from torch.distributed.tensor import DTensor

import rloo

VLLM_VERSION = "0.10.2"  # the release whose API the vLLM engine uses; requirements-vllm.txt pins it
HEARTBEAT_SECONDS = 1.0  # an engine proves it is alive this often
HEARTBEAT_TIMEOUT = 30.0  # an engine silent this long is declared dead
POLL_SECONDS = 0.01


@dataclass
class Args(rloo.Args):
    resumable_changes: ClassVar[frozenset] = rloo.Args.resumable_changes | {
        "num_engines", "launch_engines", "engine_devices", "engine_port", "engine_timeout", "sync_bucket_mb",
        "vllm_tensor_parallel_size", "vllm_gpu_memory_utilization"}

    # ----- engines -----
    engine: Literal["vllm", "hf"] = "vllm"
    """vllm: vLLM engines on GPUs (pip install -r requirements-vllm.txt). hf: each engine a process holding a
    transformers model sampling with rloo.py's own code (no vLLM needed; CPU clusters, tests)"""
    num_engines: int = 1
    """generation engines; engine r % num_engines serves training rank r, so at most as many as training ranks"""
    launch_engines: bool = True
    """trainer rank 0 starts the engines on its own node (on --engine_devices); with --no-launch_engines they are
    started elsewhere with `python rloo_multinode.py serve --trainer_address HOST:PORT --engine_index I`"""
    engine_devices: Optional[str] = None
    """comma-separated GPU ids on rank 0's node for the engines it starts, vllm_tensor_parallel_size per engine, in
    order; default: the GPUs after the training ranks' (LOCAL_WORLD_SIZE on), or the CPU"""
    engine_port: int = 29600
    """port of the engines' control store on trainer rank 0's host (MASTER_ADDR); the vLLM NCCL group uses
    engine_port + 1"""
    engine_timeout: float = 600.0
    """seconds any wait on the engines may last (start-up, a weight sync) before the run stops with an error"""
    async_generation: bool = False
    """sample batch t+1 while training on batch t, with the weights of update t-1 (staleness 1, logged as
    rollout/staleness); the PPO ratio is taken against those weights' log-probs, recomputed by the trainer"""
    sync_bucket_mb: int = 256
    """weights are broadcast in packed buckets of up to this many MB"""
    vllm_tensor_parallel_size: int = 1
    """GPUs per vLLM engine"""
    vllm_gpu_memory_utilization: float = 0.9
    """fraction of each engine GPU vLLM may take (weights + KV cache)"""


@dataclass
class ServeArgs:
    """`python rloo_multinode.py serve ...`: one engine, started by hand or by a job script, that serves a trainer."""

    trainer_address: str
    """HOST:PORT of the trainer's control store: trainer rank 0's MASTER_ADDR and --engine_port"""
    engine_index: int
    """this engine's index, 0 .. num_engines - 1"""
    device: Optional[str] = None
    """hf engine: torch device (default cuda if available, else cpu); vLLM engines use CUDA_VISIBLE_DEVICES"""
    connect_timeout: float = 3600.0
    """seconds to keep trying to reach the trainer (engines may start long before it)"""


class EngineError(rloo.RolloutSourceError):
    """An engine died, failed or stopped answering."""


def validate_engine_args(args: Args, world_size: int) -> None:
    """Refuse engine flags that clash, before anything is loaded."""
    if args.num_engines < 1:
        raise rloo.ConfigError(f"num_engines = {args.num_engines} must be at least 1")
    if args.num_engines > world_size:
        raise rloo.ConfigError(
            f"--num_engines {args.num_engines} > {world_size} training rank(s): engine r % num_engines serves rank r, "
            "so the extra engines would idle; use fewer engines, or --vllm_tensor_parallel_size to give each more GPUs")
    if args.engine == "hf" and args.vllm_tensor_parallel_size != 1:
        raise rloo.ConfigError("--vllm_tensor_parallel_size applies to --engine vllm only; the hf engine is one device")
    if args.engine == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError:
            raise rloo.ConfigError(f"--engine vllm needs vLLM {VLLM_VERSION} (pip install -r requirements-vllm.txt); "
                                   "without it pass --engine hf") from None
    if args.async_generation and args.fsdp:
        raise rloo.ConfigError("--async_generation keeps an unsharded copy of the sampling weights, which --fsdp "
                               "does not support yet; drop one of the two")


# ===================================================================== weight buckets
def engine_dtype(args: Args) -> torch.dtype:
    """The dtype weights travel and live in on the engines. The hf engine keeps fp32 weights under the trainer's
    autocast, so it samples exactly as rloo.py; vLLM runs in the compute dtype."""
    return torch.bfloat16 if args.engine == "vllm" and args.bf16 else torch.float32


def plan_buckets(named_shapes: list[tuple[str, torch.Size]], dtype: torch.dtype, bucket_bytes: int) -> list[list]:
    """Consecutive parameters grouped into buckets of at most bucket_bytes (a larger parameter alone in its own):
    [[(name, shape), ...], ...]. The same list on both sides tells the receiver how to unpack each broadcast."""
    buckets, current, size = [], [], 0
    itemsize = torch.empty((), dtype=dtype).element_size()
    for name, shape in named_shapes:
        nbytes = itemsize * int(torch.Size(shape).numel())
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append((name, tuple(shape)))
        size += nbytes
    return buckets + [current] if current else buckets


def unpack_bucket(flat: torch.Tensor, bucket: list) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) views of a flat (n,) bucket, in the bucket's order."""
    out, offset = [], 0
    for name, shape in bucket:
        n = int(torch.Size(shape).numel())
        out.append((name, flat[offset : offset + n].view(shape)))
        offset += n
    return out


def unsharded(p: torch.Tensor) -> torch.Tensor:
    """The whole parameter; with FSDP a collective: every rank must call it, in the same order."""
    return p.full_tensor() if isinstance(p, DTensor) else p


def named_parameters(policy) -> dict[str, torch.Tensor]:
    """The policy's parameters by their Hugging Face names, tied weights once (the engines tie them again). rloo.main
    hands the rollout source the policy itself, never its DDP wrapper."""
    return dict(policy.named_parameters())


# ===================================================================== weight groups
class GlooWeightGroup:
    """Trainer rank 0 (rank 0 here) and the hf engines (1 .. n): a gloo group outside torchrun's, on the control
    store; every broadcast is bounded by the timeout."""

    def __init__(self, store, rank: int, size: int, timeout: float):
        self.group = dist.ProcessGroupGloo(dist.PrefixStore("weights", store), rank, size,
                                           datetime.timedelta(seconds=timeout))
        self.options = dist.BroadcastOptions()
        self.options.rootRank, self.options.timeout = 0, datetime.timedelta(seconds=timeout)

    def broadcast(self, flat: torch.Tensor) -> torch.Tensor:
        cpu = flat.cpu()  # gloo moves host memory
        self.group.broadcast([cpu], self.options).wait()
        return cpu.to(flat.device) if flat.device != cpu.device else cpu


class NcclWeightGroup:
    """Trainer rank 0 (rank 0) and every vLLM worker: vLLM's stateless NCCL group, as its RLHF example builds it."""

    def __init__(self, host: str, port: int, rank: int, size: int, device: torch.device):
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        group = StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=size)
        self.communicator = PyNcclCommunicator(group, device=device)

    def broadcast(self, flat: torch.Tensor) -> torch.Tensor:
        self.communicator.broadcast(flat, src=0, stream=torch.cuda.current_stream())
        return flat


class VLLMWorkerExtension:
    """Methods vLLM mixes into each of its GPU workers (`worker_extension_cls`): join the weight group, receive a
    bucket and load it. vLLM's load_weights maps Hugging Face names (and shards them for tensor parallelism)."""

    def join_weight_group(self, host: str, port: int, rank_offset: int, size: int) -> None:
        from vllm.distributed.parallel_state import get_world_group

        self.weight_group = NcclWeightGroup(host, port, rank_offset + get_world_group().rank, size, self.device)

    def receive_bucket(self, bucket: list, dtype_name: str) -> None:
        numel = sum(int(torch.Size(shape).numel()) for _, shape in bucket)
        flat = torch.empty(numel, dtype=getattr(torch, dtype_name), device=self.device)
        self.weight_group.broadcast(flat)
        self.model_runner.model.load_weights(weights=unpack_bucket(flat, bucket))


# ===================================================================== engines
def dumps(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def loads(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)


class HFEngine:
    """A transformers copy of the policy that samples with rloo.py's own sampler, chunk by chunk, from the
    requesting rank's sampling RNG state: with the same weights it draws the very tokens rloo.py would."""

    def __init__(self, args: Args, device: torch.device):
        self.args, self.device = args, device
        self.model = rloo.load_causal_lm(args.sft_model_path or args.model_name_or_path, torch.float32,
                                         args.trust_remote_code).to(device).eval().requires_grad_(False)
        rloo.disable_dropout(self.model)
        self.params = dict(self.model.named_parameters())
        self.decoder = rloo.StaticDecoder(self.model, args.max_prompt_length + args.response_length) \
            if args.compile_generation else None

    def join_weight_group(self, store, rank_offset: int, size: int) -> None:
        self.group = GlooWeightGroup(store, rank_offset, size, self.args.engine_timeout)

    def receive_weights(self, buckets: list, dtype: torch.dtype) -> None:
        for bucket in buckets:
            flat = self.group.broadcast(torch.empty(sum(int(torch.Size(s).numel()) for _, s in bucket), dtype=dtype))
            for name, tensor in unpack_bucket(flat, bucket):
                self.params[name].data.copy_(tensor)

    def generate(self, request: dict) -> dict:
        generator = torch.Generator(self.device)
        generator.set_state(request["rng_state"])
        c = rloo.sample_in_chunks(
            self.model, request["queries"].to(self.device), request["query_mask"].to(self.device), self.args,
            request["stop_token_id"], request["pad_token_id"], generator,
            lambda: torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.args.bf16), self.decoder)
        return {"responses": c.responses.cpu(), "rng_state": generator.get_state()}

    def state_dict(self) -> dict:
        return {k: v.cpu() for k, v in self.model.state_dict().items()}


def vllm_engine_kwargs(args: Args, index: int) -> dict:
    """vLLM's LLM(...) arguments for engine `index`."""
    return {"model": args.sft_model_path or args.model_name_or_path,
            "dtype": str(engine_dtype(args)).removeprefix("torch."), "seed": args.seed + index,
            "tensor_parallel_size": args.vllm_tensor_parallel_size,
            "gpu_memory_utilization": args.vllm_gpu_memory_utilization, "enable_prefix_caching": True,
            "max_model_len": args.max_prompt_length + args.response_length,
            "trust_remote_code": args.trust_remote_code, "worker_extension_cls": "rloo_multinode.VLLMWorkerExtension"}


class VLLMEngine:
    """vLLM's offline LLM on this process's visible GPUs (tensor parallel over vllm_tensor_parallel_size)."""

    def __init__(self, args: Args, index: int):
        from vllm import LLM

        self.args = args
        self.llm = LLM(**vllm_engine_kwargs(args, index))

    def join_weight_group(self, store, rank_offset: int, size: int) -> None:
        host, port = store.host, store.port + 1
        self.llm.collective_rpc("join_weight_group", args=(host, port, rank_offset, size))

    def receive_weights(self, buckets: list, dtype: torch.dtype) -> None:
        for bucket in buckets:
            self.llm.collective_rpc("receive_bucket", args=(bucket, str(dtype).removeprefix("torch.")))
        self.llm.reset_prefix_cache()  # cached prompt KV was computed by the old weights

    def generate(self, request: dict) -> dict:
        from vllm import SamplingParams, TokensPrompt

        args, stop = self.args, request["stop_token_id"]
        params = SamplingParams(n=1, temperature=args.temperature, top_p=1.0, top_k=0, max_tokens=args.response_length,
                                stop_token_ids=[stop] if stop is not None else None, detokenize=False)
        prompts = [TokensPrompt(prompt_token_ids=q[m].tolist())
                   for q, m in zip(request["queries"], request["query_mask"].bool())]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        responses = torch.full((len(prompts), args.response_length), request["pad_token_id"], dtype=torch.long)
        for i, output in enumerate(outputs):
            ids = list(output.outputs[0].token_ids)[: args.response_length]
            responses[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        return {"responses": responses, "rng_state": request["rng_state"]}  # vLLM seeds its own sampler


def wait_for_key(store, key: str) -> bytes:
    """An engine's wait for the trainer: as long as it takes (the trainer may train, evaluate or save for long),
    until the key is set or the trainer's store is gone (DistNetworkError)."""
    while not store.check([key]):
        time.sleep(POLL_SECONDS)
    return store.get(key)


def heartbeat(host: str, port: int, index: int, stop: threading.Event) -> None:
    """Tick engine/<index>/beats every HEARTBEAT_SECONDS on a connection of its own, so a long generation or a
    busy interpreter never looks like death."""
    store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=60))
    while not stop.wait(HEARTBEAT_SECONDS):
        try:
            store.add(f"engine/{index}/beats", 1)
        except dist.DistError:  # the trainer is gone; the main loop notices too
            return


def serve(serve_args: ServeArgs) -> None:
    """One engine: connect, load, join the weight group, then follow the trainer's command stream until `stop`."""
    host, port = serve_args.trainer_address.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False,
                          timeout=datetime.timedelta(seconds=serve_args.connect_timeout))
    index = serve_args.engine_index
    rloo.quiet_hub_progress_bars()
    config = loads(store.get("config"))  # blocks until the trainer has published it
    args = Args(**config["args"])
    stop_beating = threading.Event()
    threading.Thread(target=heartbeat, args=(host, int(port), index, stop_beating), daemon=True).start()
    try:
        if args.engine == "hf":
            device = torch.device(serve_args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
            if device.type != config["trainer_device_type"]:
                raise rloo.ConfigError(f"the hf engine samples from the trainer's RNG state, so it must run on the "
                                       f"trainer's device type ({config['trainer_device_type']}), not {device.type}")
            engine = HFEngine(args, device)
        else:
            engine = VLLMEngine(args, index)
        store.set(f"engine/{index}/ready", json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
        engine.join_weight_group(store, config["rank_offsets"][index], config["group_size"])
        ranks = list(range(index, config["world_size"], args.num_engines))
        for step in itertools.count():
            command = loads(wait_for_key(store, f"cmd/{step}"))  # every engine reads every command
            if command["kind"] == "stop":
                break
            if command["kind"] == "sync":
                store.set(f"engine/{index}/at_sync/{command['version']}", b"1")
                engine.receive_weights(command["buckets"], command["dtype"])
            elif command["kind"] == "generate":
                for rank in ranks:
                    request = loads(wait_for_key(store, f"gen/{command['batch']}/{rank}"))
                    store.delete_key(f"gen/{command['batch']}/{rank}")
                    result = engine.generate(request)
                    store.set(f"out/{command['batch']}/{rank}", dumps(result))
            elif command["kind"] == "state_dict":  # for checking a sync: this engine's weights, to the trainer
                store.set(f"engine/{index}/state_dict/{command['version']}", dumps(engine.state_dict()))
    except dist.DistNetworkError:  # the trainer's store is gone: it stopped or died; nothing left to serve
        return
    except Exception as e:
        with contextlib.suppress(dist.DistError):
            store.set("failed", f"engine {index} ({socket.gethostname()}, pid {os.getpid()}) failed: "
                                f"{type(e).__name__}: {e}")
        raise
    finally:
        stop_beating.set()


# ===================================================================== trainer side
class EngineRollouts:
    """rloo.py's rollout source (the five methods of rloo.LocalRollouts), served by engines. Every training rank
    submits its own queries and takes its own completions; rank 0 also writes the command stream and sends the
    weights."""

    def __init__(self, policy, args: Args, stop_token_id: Optional[int], pad_token_id: int,
                 generator: torch.Generator, dist_info: rloo.Dist, store, processes: dict):
        self.policy, self.args, self.stop_token_id, self.pad_token_id = policy, args, stop_token_id, pad_token_id
        self.generator, self.queued = generator, []  # (queries, query mask) of each batch in flight
        self.dist_info, self.store, self.processes = dist_info, store, processes
        self.lookahead = 1 if args.async_generation else 0
        self.submitted = self.taken = self.next_command = 0  # batches asked for and received; rank 0's commands
        self.version = 0  # the policy's update count when the engines last received its weights
        self.batch_versions = []  # the weight version that sampled each batch in flight
        self.beats, self.behaviour, self.snapshots = {}, None, {}
        if args.async_generation:
            self.behaviour = copy.deepcopy(policy).eval().requires_grad_(False)
            self.behaviour_version = 0
        dtype = engine_dtype(args)
        shapes = [(name, p.shape) for name, p in named_parameters(policy).items()]  # a DTensor's shape is the full one
        self.buckets, self.dtype = plan_buckets(shapes, dtype, args.sync_bucket_mb * 2**20), dtype
        self.group = None
        if dist_info.master:
            self.wait_for_engines()
        self.sync_weights(0)  # the engines start from the trainer's weights, whatever they loaded

    # ---- rank 0: engines and commands
    def command(self, **command) -> None:
        self.store.set(f"cmd/{self.next_command}", dumps(command))
        self.next_command += 1

    def check_engines(self) -> None:
        """Raise EngineError naming the first engine found dead, failed or silent."""
        if self.store.check(["failed"]):
            raise EngineError(self.store.get("failed").decode())
        for index, process in self.processes.items():
            if process.poll() is not None:
                raise EngineError(f"engine {index} (pid {process.pid}) exited with status {process.returncode}")
        now = time.monotonic()
        for index in range(self.args.num_engines):
            beats = self.store.add(f"engine/{index}/beats", 0)
            last_beats, since = self.beats.get(index, (-1, now))
            if beats != last_beats:
                self.beats[index] = (beats, now)
            elif now - since > HEARTBEAT_TIMEOUT:
                raise EngineError(f"engine {index} sent no heartbeat for {HEARTBEAT_TIMEOUT:.0f} s")

    def wait_for(self, key: str, what: str, timeout: Optional[float]) -> bytes:
        """The value of `key` once some engine sets it; EngineError if an engine fails meanwhile or `timeout`
        seconds pass (None: as long as the engines are alive)."""
        start = checked = time.monotonic()
        self.check_engines()
        while not self.store.check([key]):
            if time.monotonic() - checked > HEARTBEAT_SECONDS:  # a few store calls per engine; not at every poll
                self.check_engines()
                checked = time.monotonic()
            if timeout is not None and time.monotonic() - start > timeout:
                raise EngineError(f"no engine answered within --engine_timeout {timeout:.0f} s: waiting for {what}")
            time.sleep(POLL_SECONDS)
        value = self.store.get(key)
        self.store.delete_key(key)
        return value

    def wait_for_engines(self) -> None:
        """Every engine loaded and ready; then the weight group is formed, every member at once."""
        for index in range(self.args.num_engines):
            self.wait_for(f"engine/{index}/ready", f"engine {index} to load its model", self.args.engine_timeout)
        size = self.store.add("group_size", 0)
        if self.args.engine == "hf":
            self.group = GlooWeightGroup(self.store, 0, size, self.args.engine_timeout)
        else:
            self.group = NcclWeightGroup(self.store.host, self.store.port + 1, 0, size, self.dist_info.device)

    # ---- weights
    def sync_weights(self, version: int) -> tuple[float, float]:
        """Rank 0 broadcasts the weights bucket by bucket; with FSDP every rank gathers each bucket's parameters
        first (one bucket unsharded at a time, never the whole model). Returns rank 0's seconds waiting for the
        engines to be ready (an engine still sampling an async batch finishes it first) and seconds sending."""
        master, wait = self.dist_info.master, 0.0
        if not master and not self.args.fsdp:
            return 0.0, 0.0
        if master:
            start = time.perf_counter()
            self.command(kind="sync", version=version, buckets=self.buckets, dtype=self.dtype)
            for index in range(self.args.num_engines):
                self.wait_for(f"engine/{index}/at_sync/{version}", f"engine {index} to receive weights",
                              self.args.engine_timeout)
            wait = time.perf_counter() - start
        start, error, parameters = time.perf_counter(), None, named_parameters(self.policy)
        for bucket in self.buckets:
            tensors = [unsharded(parameters[name]).detach() for name, _ in bucket]  # (FSDP: all ranks gather)
            if master and error is None:
                try:
                    self.group.broadcast(torch.cat([t.reshape(-1).to(self.dtype) for t in tensors]))
                except RuntimeError as e:  # a peer died or timed out; keep gathering so no rank hangs
                    error = e
        if error is not None:
            self.check_engines()
            raise EngineError(f"weight sync {version} failed: {error}")
        return wait, time.perf_counter() - start

    def engine_state_dict(self, index: int) -> dict:
        """Rank 0: engine `index`'s weights as it holds them now (to check a sync)."""
        self.command(kind="state_dict", version=self.version)
        return loads(self.wait_for(f"engine/{index}/state_dict/{self.version}", f"engine {index}'s weights",
                                   self.args.engine_timeout))

    # ---- the rollout source
    def submit(self, queries: torch.Tensor, query_mask: torch.Tensor) -> None:
        batch, rank = self.submitted, self.dist_info.rank
        self.store.set(f"gen/{batch}/{rank}", dumps({
            "queries": queries.cpu(), "query_mask": query_mask.cpu(), "stop_token_id": self.stop_token_id,
            "pad_token_id": self.pad_token_id, "rng_state": self.generator.get_state()}))
        if self.dist_info.master:
            self.command(kind="generate", batch=batch)
        self.batch_versions.append(self.version)
        self.submitted += 1
        self.queued.append((queries, query_mask))

    def take(self) -> tuple[rloo.Completions, dict[str, float]]:
        queries, query_mask = self.queued.pop(0)
        try:
            result = loads(self.wait_for(f"out/{self.taken}/{self.dist_info.rank}", "completions", None))
            failed = 0.0
        except EngineError as e:
            error, failed = e, 1.0
        # every rank stops at this same point, or none does
        if rloo.all_reduce(torch.tensor([failed], device=self.dist_info.device), dist.ReduceOp.MAX).item():
            raise error if failed else EngineError(self.store.get("failed").decode() if self.store.check(["failed"])
                                                   else "an engine serving another rank failed")
        self.generator.set_state(result["rng_state"])
        responses, response_mask = rloo.truncate_after_stop(result["responses"].to(queries.device),
                                                            self.stop_token_id, self.pad_token_id)  # (k*B, Tr)
        completions = rloo.Completions(torch.cat([queries, responses], 1), torch.cat([query_mask, response_mask], 1),
                                       response_mask, queries.shape[1])
        sampled_by = self.batch_versions.pop(0)
        self.taken += 1
        self.load_behaviour(sampled_by)
        return completions, {"rollout/staleness": float(self.version - sampled_by)}

    def load_behaviour(self, version: int) -> None:
        """Async: the behaviour copy holds the weights of `version`, the ones that sampled the batch just taken."""
        if self.behaviour is None or self.behaviour_version == version:
            return
        self.behaviour.load_state_dict(self.snapshots.pop(version), strict=False)
        self.behaviour_version = version
        for old in [v for v in self.snapshots if v < version]:
            del self.snapshots[old]

    def behaviour_policy(self, policy):
        return self.behaviour if self.behaviour is not None else policy

    def policy_updated(self, update: int, policy) -> dict[str, float]:
        self.version = update
        if self.behaviour is not None:  # batches sampled with these weights are trained on one update later
            self.snapshots[update] = {name: p.detach().to("cpu", copy=True)
                                      for name, p in named_parameters(policy).items()}  # never FSDP (refused)
        try:
            wait, broadcast = self.sync_weights(update)
        except EngineError as e:  # raised at the next take(), on every rank at once, after a checkpoint
            if not self.store.check(["failed"]):
                self.store.set("failed", str(e))
            wait = broadcast = 0.0
        return {"time/engine_wait": wait, "time/weight_sync": broadcast}

    def close(self) -> None:
        if self.dist_info.master:
            with contextlib.suppress(dist.DistError):
                self.command(kind="stop")
        for process in self.processes.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


# ===================================================================== launching
def engine_device_lists(args: Args, dist_info: rloo.Dist) -> list[Optional[str]]:
    """CUDA_VISIBLE_DEVICES of each engine rank 0 starts (None: the CPU)."""
    if dist_info.device.type != "cuda":
        return [None] * args.num_engines
    per_engine = args.vllm_tensor_parallel_size
    if args.engine_devices is not None:
        devices = [d.strip() for d in args.engine_devices.split(",") if d.strip()]
    else:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        devices = [str(d) for d in range(local_world, torch.cuda.device_count())]
    if len(devices) < per_engine * args.num_engines:
        raise rloo.ConfigError(
            f"{args.num_engines} engine(s) x {per_engine} GPU(s) need {per_engine * args.num_engines} GPUs, but "
            f"--engine_devices gives {len(devices)} ({','.join(devices) or 'none'}); free GPUs for them or pass "
            "--no-launch_engines and start engines on other nodes")
    return [",".join(devices[i * per_engine : (i + 1) * per_engine]) for i in range(args.num_engines)]


def launch_engines(args: Args, dist_info: rloo.Dist, address: str) -> dict[int, subprocess.Popen]:
    """Rank 0 starts the engines as child processes of this script's `serve` mode; their output goes to
    output_dir/engine_<i>.log."""
    processes, placement = {}, {}
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    for index, devices in enumerate(engine_device_lists(args, dist_info)):
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
        if devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = devices
        log = open(Path(args.output_dir) / f"engine_{index}.log", "w")
        processes[index] = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "serve", "--trainer_address", address,
             "--engine_index", str(index)] + (["--device", "cuda:0"] if devices is not None else []),
            env=env, stdout=log, stderr=subprocess.STDOUT)
        placement[index] = {"pid": processes[index].pid, "cuda_visible_devices": devices}
    (Path(args.output_dir) / "engines.json").write_text(json.dumps(placement, indent=2))
    return processes


def control_store(args: Args, dist_info: rloo.Dist, device_type: str):
    """The engines' control store, served by rank 0; rank 0 publishes the run's configuration in it."""
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    store = dist.TCPStore(host, args.engine_port, is_master=dist_info.master, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=args.engine_timeout))
    if dist_info.master:
        workers = [1 if args.engine == "hf" else args.vllm_tensor_parallel_size] * args.num_engines
        offsets = [1 + sum(workers[:i]) for i in range(args.num_engines)]
        store.add("group_size", 1 + sum(workers))
        store.set("config", dumps({"args": asdict(args), "world_size": dist_info.world_size,
                                   "rank_offsets": offsets, "group_size": 1 + sum(workers),
                                   "trainer_device_type": device_type}))
    return store, f"{host}:{args.engine_port}"


# ===================================================================== main
def make_engine_rollouts(args: Args):
    """rloo.main's rollout source: the control store and, on rank 0, the engines it starts."""

    def make(policy, args_, stop_token_id, pad_token_id, generator, autocast):  # engines sample in their own dtype
        dist_info = rloo.Dist(int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)),
                              int(os.environ.get("WORLD_SIZE", 1)), generator.device)
        store, address = control_store(args, dist_info, generator.device.type)
        processes = launch_engines(args, dist_info, address) if dist_info.master and args.launch_engines else {}
        return EngineRollouts(policy, args, stop_token_id, pad_token_id, generator, dist_info, store, processes)

    return make


def main(args: Args) -> None:
    validate_engine_args(args, int(os.environ.get("WORLD_SIZE", 1)))
    rloo.main(args, make_rollouts=make_engine_rollouts(args))


def cli() -> None:
    if sys.argv[1:2] == ["serve"]:
        serve_args = tyro.cli(ServeArgs, args=sys.argv[2:], prog="rloo_multinode.py serve")
        rloo.run_script(serve, serve_args, "rloo_multinode.py serve")
        return
    args = tyro.cli(Args)
    try:
        rloo.run_script(main, args, "rloo_multinode.py")
    except rloo.RolloutSourceError as e:
        print(f"rloo_multinode.py: error: {e}; continue with the same command and --resume once the engines are "
              "healthy", file=sys.stderr)
        sys.exit(4)


if __name__ == "__main__":
    cli()
