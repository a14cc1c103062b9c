"""torchrun's ranks: the process group and each rank's device and seed, FSDP2 sharding and gathering, all-reduce and
statistics over ranks, and ranks waiting for each other (a late rank is named, with the phase it is in).
"""

import contextlib
import datetime
import gc
import json
import os
import random
import socket
import sys
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from .errors import ConfigError, Fault, first_line, program
from .threads import interruptible

__all__ = [  # given as plumbing.NAME to rloo.py, rloo_multinode.py and the tools; tests import the rest from the module
    "Dist", "setup_distributed", "for_training", "transformer_blocks", "visiting", "is_fsdp_unit",
    "gathered_for_rollout", "reshard", "unwrapped", "all_reduce", "same_plan", "global_mean_std", "note_phase",
    "barrier", "end_distributed", "gradient_sync",
]


@dataclass(frozen=True)
class Dist:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def master(self) -> bool:
        return self.rank == 0


def setup_distributed(timeout: float = 1800.0) -> Dist:
    """torch.distributed from torchrun's RANK/LOCAL_RANK/WORLD_SIZE: NCCL on GPUs, gloo on CPU; a collective that
    waits longer than `timeout` seconds for another rank fails instead of waiting on (so does wait_for_peers: the
    process group's store has the same timeout)."""
    if "RANK" not in os.environ:  # plain `python rloo.py`
        return Dist(0, 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    rank, local_rank, world_size = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    if torch.cuda.is_available():
        gpus, ranks_here = torch.cuda.device_count(), os.environ.get("LOCAL_WORLD_SIZE", "?")
        if local_rank >= gpus:
            raise ConfigError(f"{ranks_here} ranks on this node but {gpus} GPU(s) visible: one rank per GPU, so launch "
                              f"with --nproc_per_node {gpus}; for a CPU (gloo) run, set CUDA_VISIBLE_DEVICES=")
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"

    def join() -> None:  # gloo too on GPUs: collectives on CPU tensors (--offload's gradient shards, their norm)
        if device.type == "cuda":
            torch.cuda.set_device(device)  # this thread's device too
        dist.init_process_group(backend="cuda:nccl,cpu:gloo" if backend == "nccl" else backend,
                                timeout=datetime.timedelta(seconds=timeout))

    address = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} (MASTER_ADDR:MASTER_PORT)"

    def unanswered() -> None:  # said once, by each rank that waits: the wait itself goes on
        problem = rendezvous_problem(os.environ.get("MASTER_ADDR", ""), int(os.environ.get("MASTER_PORT", "0")))
        if problem:
            print(f"{program()}: rank {rank}: the rendezvous at {address} does not answer ({problem}); "
                  f"waiting on, up to --ddp_timeout {timeout:g} s: check the address, and that rank 0 has started",
                  file=sys.stderr, flush=True)

    # waited for in a thread: the wait for the other ranks, in C++, would keep a stop signal's handler from running
    # until every rank had joined (torchrun's SIGTERM once a rank failed while starting: 30 s, then SIGKILL)
    started = time.monotonic()
    try:
        interruptible(join, "init_process_group", meanwhile=(min(RENDEZVOUS_NOTICE, timeout / 2), unanswered))
    except ValueError as e:  # torch's env:// rendezvous refusing a variable (an empty MASTER_ADDR)
        raise ConfigError(f"rank {rank}: torch.distributed refused the launch's environment: {first_line(e)}; launch "
                          "with torchrun, or set MASTER_ADDR and MASTER_PORT") from None
    except dist.DistError as e:  # the store never answered, the other ranks never joined it, or one of them ended
        raise Fault(f"rank {rank}: the rendezvous at {address} failed after {time.monotonic() - started:.0f} s "
                    f"(--ddp_timeout {timeout:g} s): {first_line(e).rstrip('.')}; check the address, and that every "
                    "rank starts", announce=not stopped_alone()) from None
    return Dist(rank, local_rank, world_size, device)


RENDEZVOUS_NOTICE = 3.0  # seconds init_process_group waits before the rendezvous's address is tried and, silent, said


def rendezvous_problem(host: str, port: int) -> Optional[str]:
    """Why nothing answers a TCP connection to the rendezvous at host:port within 3 s, in words; None when it
    answers (the other ranks may still be on their way: a wait of their own)."""
    try:
        with socket.create_connection((host, port), timeout=3.0):
            return None
    except socket.gaierror as e:
        return f"{host!r} does not resolve: {e.strerror}"
    except ConnectionRefusedError:
        return "connection refused: nothing listens there"
    except TimeoutError:
        return "no answer within 3 s"
    except OSError as e:
        return e.strerror or str(e)


def for_training(policy, fsdp: bool, bf16: bool, offload: bool, device: torch.device):
    """The policy as training calls it: sharded in place with --fsdp (shard_policy: `policy` is then the sharded
    module), wrapped in DDP across ranks, or the policy itself in one process."""
    if fsdp:
        return shard_policy(policy, bf16, offload)
    if dist.is_initialized():
        return DDP(policy, device_ids=[device.index] if device.type == "cuda" else None)
    return policy


def shard_policy(policy, bf16: bool, offload: bool = False):
    """FSDP2 over all ranks: one unit per transformer block (the classes in the model's `_no_split_modules`), the
    embeddings and head in the root unit. fp32 master weights; bf16 compute with --bf16; gradients reduced in fp32
    (they sum log-prob gradients over thousands of tokens). With `offload` the shards, their gradients and so the
    optimizer state stay in CPU memory; a unit's weights visit the GPU while it computes. LoRA adapters, added
    before, are sharded and gathered with the block they sit in, beside its frozen base weights (sharded too)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    blocks = transformer_blocks(policy)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)
    placement = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
    for block in blocks:
        fully_shard(block, mp_policy=mp, offload_policy=placement)
    fully_shard(policy, mp_policy=mp, offload_policy=placement)
    if not reduce_scatter_averages(torch.device("cuda" if torch.cuda.is_available() else "cpu")):
        # FSDP2 averages fp32 gradients with ReduceOp.AVG; where that sums, have it sum and divide itself
        units = [m for m in policy.modules() if is_fsdp_unit(m)]
        if not hasattr(policy, "set_force_sum_reduction_for_comms"):
            raise ConfigError(f"--fsdp: this torch's {dist.get_backend()} reduce-scatter sums where FSDP2 asks it "
                              "to average, and this FSDP2 cannot work around it: use torch >= 2.8")
        for unit in units:
            unit.set_force_sum_reduction_for_comms(True)
    return policy


def transformer_blocks(policy) -> list:
    """The modules --fsdp shards one by one: the blocks of the classes the model's `_no_split_modules` names; a
    model that names none is refused (plan_memory.py checks the same on its meta-device model)."""
    block_classes = set(getattr(policy, "_no_split_modules", None) or ())
    blocks = [m for m in policy.modules() if type(m).__name__ in block_classes]
    if not blocks:
        raise ConfigError(f"--fsdp: {type(policy).__name__} names no transformer block class (_no_split_modules) "
                          "to shard by; drop --fsdp to replicate it with DDP")
    return blocks


def reduce_scatter_averages(device: torch.device) -> bool:
    """Whether ReduceOp.AVG averages in this process group's reduce-scatter. gloo in torch 2.7 and 2.8 silently
    sums instead (NCCL averages)."""
    out = torch.zeros(1, device=device)
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # the newer name
    reduce_scatter(out, torch.ones(dist.get_world_size(), device=device), op=dist.ReduceOp.AVG)
    return out.item() == 1.0


@contextlib.contextmanager
def visiting(model, device: torch.device):
    """A frozen model kept in CPU memory (--offload) comes to `device` for one phase's forward passes and goes back
    after; a model already there (or None) stays where it is."""
    home = next(model.parameters()).device if model is not None else device
    if home == device:
        yield
        return
    model.to(device)
    try:
        yield
    finally:
        model.to(home)


def is_fsdp_unit(module) -> bool:
    """isinstance(module, FSDPModule), without importing FSDP2 in runs that never shard: until something imports
    it, nothing can be one."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(module, fsdp.FSDPModule)


@contextlib.contextmanager
def gathered_for_rollout(policy, mode: str):
    """For sampling and evaluation with an FSDP policy. mode "unshard": every block's weights are gathered at its
    first forward and kept for the whole block of code, not gathered again at each decoding step. On exit every
    unit is resharded, the root too: a forward pass without backward leaves the root's weights gathered, and the
    parameters then registered on the module are not the ones the optimizer holds. Without FSDP, nothing."""
    blocks = [m for m in policy.modules() if is_fsdp_unit(m) and m is not policy] \
        if mode == "unshard" else []
    if blocks and not hasattr(blocks[0], "set_reshard_after_forward"):
        raise ConfigError("--fsdp_generation unshard needs FSDPModule.set_reshard_after_forward (torch >= 2.8): "
                          "upgrade torch, or pass --fsdp_generation per_block")
    for block in blocks:
        block.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        reshard(policy)
        for block in blocks:
            block.set_reshard_after_forward(True, recurse=False)


def reshard(policy) -> None:
    """Every FSDP unit of the policy back to its shards: its parameters are the sharded ones again, which the
    optimizer holds (without FSDP, nothing)."""
    for unit in policy.modules():
        if is_fsdp_unit(unit):
            unit.reshard()


def unwrapped(model):
    """The module DDP wraps, or the model itself: what holds the config, the forward's signature and the weights."""
    return model.module if isinstance(model, DDP) else model


def all_reduce(x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce when distributed; identity in a single process."""
    if dist.is_initialized():
        dist.all_reduce(x, op=op)
    return x


def same_plan(plan: str) -> None:
    """Collective: every rank's `plan` of what it does next in an update's training (its next optimizer step and the
    micro-batches it takes, or the end of its steps: what decides the collectives it calls) is the same, or every rank
    raises a Fault naming what each rank would do. Ranks that went on apart would meet in collectives of other sizes
    ("Received data size doesn't match") or wait until --ddp_timeout, far from the cause; one small all_gather here
    names it."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    plans = [None] * dist.get_world_size()
    dist.all_gather_object(plans, plan)
    if len(set(plans)) == 1:
        return
    ranks = {}
    for rank, each in enumerate(plans):
        ranks.setdefault(each, []).append(str(rank))
    raise Fault("the ranks would diverge at an optimizer step: " + "; ".join(
        f"rank{'s' * (len(r) > 1)} {', '.join(r)}: {each}" for each, r in ranks.items()) + "; every rank must take the "
        "same path through an update (decide it from values reduced over ranks, which every rank holds alike)",
        announce=dist.get_rank() == 0)


def global_mean_std(x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and (unbiased) std of the masked entries of x over all ranks."""
    mask = torch.ones_like(x, dtype=torch.bool) if mask is None else mask
    x = torch.where(mask, x.float(), 0.0)  # a masked-out NaN (a completion no reward source scored) counts nothing
    moments = all_reduce(torch.stack([x.sum(), (x * x).sum(), mask.sum().float()]))  # (3,)
    total, total_sq, count = moments
    mean = total / count
    var = (total_sq - count * mean * mean) / (count - 1).clamp(min=1)
    return mean, var.clamp(min=0).sqrt()


# ---- ranks waiting for each other: who is late, and where
def process_group_store():
    """The store of the ranks' process group (torchrun's rendezvous store, under a prefix of its own), where the
    ranks publish their phases and count their barriers. None in a single process, or in a torch whose
    ProcessGroup lacks get_group_store (older ones: plain barriers, no late rank named)."""
    if not dist.is_initialized() or not hasattr(dist.group.WORLD, "get_group_store"):
        return None
    return dist.group.WORLD.get_group_store()


def note_phase(name: str) -> None:
    """Record the phase this rank is in (with several ranks, in the store): a rank that waits too long for another
    can then say what that one is doing."""
    store = process_group_store()
    if store is not None:
        store.set(f"rloo/phase/{dist.get_rank()}", json.dumps([name, time.time()]))


def wait_for_peers(what: str) -> None:
    """A barrier of all ranks through the store, at most --ddp_timeout long. A rank that has not arrived by then
    (a reward function that never returns, a dead node) makes every waiting rank raise a Fault naming it and the
    phase it is in, said once by the lowest waiting rank; a collective would wait as long, then fail without
    saying which rank nor where. The wait times out as the collectives do: init_process_group gives the store
    their timeout."""
    store = process_group_store()
    if store is None:
        if dist.is_initialized():
            dist.barrier()
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    passed = store.add(f"rloo/barriers_of/{rank}", 1)  # every rank passes the same barriers in the same order
    key, waiting = f"rloo/barrier/{passed}", f"waiting for the other ranks after {what}"
    note_phase(waiting)
    if store.add(key, 1) == world:
        store.set(f"{key}/all", "1")
    try:
        store.wait([f"{key}/all"])
    except RuntimeError:  # DistStoreError: the wait timed out
        now, phases = time.time(), {}
        for r in range(world):
            phases[r] = json.loads(store.get(f"rloo/phase/{r}")) if store.check([f"rloo/phase/{r}"]) \
                else ["start-up", None]
        late = [r for r in range(world) if phases[r][0] != waiting]
        where = "; ".join(f"rank {r} is in {phases[r][0]!r}" + (f" since {now - phases[r][1]:.0f} s" if phases[r][1]
                                                                  else "") for r in late)
        waited = store.timeout.total_seconds()
        raise Fault(f"the other ranks waited --ddp_timeout {waited:g} s after {what}: {where} (stuck: a "
                    "reward function that never returns, a dead node; or slower than that: raise --ddp_timeout); "
                    "nothing saved, a checkpoint needs every rank", announce=rank == min(set(range(world)) - set(late),
                                                                             default=rank)) from None
    note_phase(f"after {what}")


STOPPED_ALONE = "rloo/stopped_alone"  # set by a rank that stops on its own: the others' failed collectives echo it


def stopped_alone(mark: bool = False) -> bool:
    """Whether a rank has marked (with `mark`: marks) in the store that it stops on its own, having said why: the
    process group's, or before it exists (a rank stopped while starting, the others waiting for it to join) torchrun's
    own, under this launch's id."""
    store, key = process_group_store(), STOPPED_ALONE
    with contextlib.suppress(RuntimeError):  # the store is gone too: nothing to say or learn
        if store is None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                  timeout=datetime.timedelta(seconds=10))
            key = "/".join([STOPPED_ALONE, *(os.environ.get(k, "") for k in ("TORCHELASTIC_RUN_ID",
                                                                              "TORCHELASTIC_RESTART_COUNT"))])
        if store is not None and mark:
            store.set(key, "1")
        return store is not None and store.check([key])
    return False


def barrier(what: str = "a barrier") -> None:
    wait_for_peers(what)


def end_distributed() -> None:
    """The process group torn down, once the caller has dropped its DDP wrapper. DDP's reducer holds the group too;
    were it the last holder, its destructor, which keeps the GIL, would join gloo's worker threads while one of them
    waits for the GIL to free a tensor: a hang at the very end of a CPU run (pytorch#56297). Collected first (the gc
    for its reference cycles), the wrapper leaves the group to destroy_process_group, which frees it without the GIL."""
    if dist.is_initialized():
        gc.collect()  # a full collection: ~1 s of a busy CPU, needed only here
        dist.destroy_process_group()


def rank0_view(value):
    """Rank 0's value on every rank: one listing of a shared directory, whichever node's cache is behind."""
    if not dist.is_initialized():
        return value
    shared = [value]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@contextlib.contextmanager
def gradient_sync(model, enabled: bool):
    """DDP all-reduces gradients only when `enabled` (an optimizer step's last micro-step). FSDP reduce-scatters at
    every micro-step, as ZeRO-3 does: more traffic, but no rank ever holds a full-size gradient; but when it trains
    LoRA adapters (peft's, whose full gradients are small) it too only when `enabled`, the micro-steps' gradients
    summed unsharded in fp32 meanwhile."""
    if isinstance(model, DDP) and not enabled:
        with model.no_sync():
            yield
    elif is_fsdp_unit(model) and hasattr(model, "peft_config") and not enabled:
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield
