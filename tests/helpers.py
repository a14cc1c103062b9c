"""The tests' shared helpers, in one module of their own (test files import from here, never from each other): tiny
models and tokenizers built in code (no network), prompt files, running rloo.py as a user would (a process of its own)
or in the test's process (one import shared by every run), and the checks of a resumed run. conftest.py holds the
fixtures (the tiny assets, built once per session) and keeps these names importable from it."""

import atexit
import contextlib
import functools
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch
import transformers
from safetensors.torch import load_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (GPTNeoXConfig, GPTNeoXForCausalLM, GPTNeoXForSequenceClassification,
                          PreTrainedTokenizerFast)

REPO = Path(__file__).resolve().parent.parent
# The repository's own text (.ci/run sets it): the tests pinned to rloo.py's documented text fail where it differs
STOCK = os.environ.get("RLOO_STOCK") == "1"


def stock_text_differs(why: str) -> None:
    """For a test pinned to rloo.py's documented text (a worked example's lines, a mutant's snippet, the metrics and
    shapes the docs explain), where this checkout's text differs: in a copy that changed it, one line saying so and the
    test skipped (it checks the stock text, not the change); with RLOO_STOCK=1, the project's CI, a failure (there the
    text is the documented one, and a difference is documentation to bring up to date)."""
    import pytest

    said = f"the copy's text differs from the documented text: {why}"
    if STOCK:
        pytest.fail(f"{said} (RLOO_STOCK=1: this repository's text must be the documented one)", pytrace=False)
    pytest.skip(f"{said}; this test pins the stock rloo.py (RLOO_STOCK=1 makes it fail)")
sys.path.insert(0, str(REPO))  # rloo.py is a script at the top level, not a package
LETTERS = "abcdefghijkl"

import plumbing  # noqa: E402  (from REPO, put on the path above)
import forked_python  # noqa: E402
import rloo  # noqa: E402
import rloo_multinode  # noqa: E402


def word_tokenizer(words: list[str], pad: str | None = "<pad>", eos: str = "<eos>") -> PreTrainedTokenizerFast:
    """Whitespace word-level tokenizer; ids follow the order of `words` (special tokens included there)."""
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    special = {"eos_token": eos} | ({"pad_token": pad} if pad else {})
    return PreTrainedTokenizerFast(tokenizer_object=backend, padding_side="left", **special)


def policy_tokenizer() -> PreTrainedTokenizerFast:
    return word_tokenizer(["<pad>", "<eos>", *LETTERS, ":"])


def neox_config(vocab_size: int, **overrides) -> GPTNeoXConfig:
    return GPTNeoXConfig(**{"vocab_size": vocab_size, "hidden_size": 32, "num_hidden_layers": 2,
                            "num_attention_heads": 4, "intermediate_size": 64, "max_position_embeddings": 64,
                            "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 1, **overrides})


def tiny_policy(vocab_size: int, seed: int = 0) -> GPTNeoXForCausalLM:
    torch.manual_seed(seed)
    return GPTNeoXForCausalLM(neox_config(vocab_size)).eval()


def tiny_reward_model(vocab_size: int, seed: int = 0, **config) -> GPTNeoXForSequenceClassification:
    torch.manual_seed(seed)
    return GPTNeoXForSequenceClassification(neox_config(vocab_size, num_labels=1, **config)).eval()


# tiny models of today's architectures (2 layers, hidden 32); a window of 4 is shorter than every prompt + response
TINY = {"vocab_size": len(policy_tokenizer()), "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 64, "max_position_embeddings": 64, "pad_token_id": 0,
        "eos_token_id": 1, "bos_token_id": 1}
ARCHITECTURES = {  # family: (config class, its settings, None if it shares prompts, else what its fallback line says)
    "llama": (transformers.LlamaConfig, {}, None),  # full attention
    "gpt2": (transformers.GPT2Config, {}, None),  # learned positions, tied embeddings
    "mistral": (transformers.MistralConfig, {"sliding_window": 4}, None),  # every layer sliding
    "gemma2": (transformers.Gemma2Config, {"head_dim": 8, "sliding_window": 4}, None),  # sliding / full, soft-capping
    "gpt_oss": (transformers.GptOssConfig, {"head_dim": 8, "sliding_window": 4, "num_local_experts": 4,
                                            "num_experts_per_tok": 2}, None),  # sliding / full, sinks, experts, eager
    "qwen3_moe": (transformers.Qwen3MoeConfig, {"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
                                                "moe_intermediate_size": 16}, None),  # mixture of experts
    "falcon_h1": (transformers.FalconH1Config, {"head_dim": 8, "mamba_d_ssm": 32, "mamba_n_heads": 4, "mamba_d_head": 8,
                                                "mamba_n_groups": 1, "mamba_d_state": 8, "mamba_chunk_size": 8},
                  "its hybrid layers read the whole row in order"),  # attention + state-space in each layer
}


def lora_targets(family: str) -> tuple[str, ...]:
    """--lora_target_modules for adapters on every linear layer of the family's model: all-linear, but for Falcon-H1
    its attention and its Mamba in_proj (peft refuses Mamba's out_proj, which all-linear reaches, in one line)."""
    return ("q_proj", "v_proj", "in_proj") if family == "falcon_h1" else ("all-linear",)


def architecture_config(family: str, **changes):
    """The family's tiny config (made when asked for: transformers warns about some of them as it makes them, which
    a script importing this file would print)."""
    config_class, settings, _ = ARCHITECTURES[family]
    return config_class(**TINY, **settings, **changes)


def tiny_architecture(family: str, head: str = "ForCausalLM", seed: int = 0, likely_eos: bool = True):
    torch.manual_seed(seed)
    config = architecture_config(family, num_labels=1)
    name = type(config).__name__.removesuffix("Config") + ("LMHeadModel" if family == "gpt2" and head == "ForCausalLM"
                                                           else head)
    model = getattr(transformers, name)(config).eval()
    with torch.no_grad():
        for layer in model.model.layers if family == "falcon_h1" else ():
            layer.mamba.out_proj.weight *= 300  # at init the state-space half barely moves the logits: a lost state
            # would not change a greedy token
        if head == "ForCausalLM" and likely_eos:
            model.get_output_embeddings().weight[1] *= 3  # responses of uneven lengths
    return model


def policy_loss_of(new, old, advantages, mask, cliprange=0.2, per_token=False, entropy=None, in_loss=None,
                   sampler_logprobs=None, ref_logprobs=None, **flags):
    """rloo.policy_loss of loose tensors, log-probs and mask (N, Tr): a micro-batch of N completions (of one-token
    prompts) holding them, and Args with the flags (per_token: --token_level_kl)."""
    import rloo
    batch = rloo.Rollout(torch.ones(len(new), 1, dtype=torch.long), torch.ones(len(new), 1, dtype=torch.bool),
                         torch.ones(new.shape, dtype=torch.long), mask.bool(), old, ref_logprobs, in_loss=in_loss,
                         sampler_logprobs=sampler_logprobs)
    values = rloo.Advantages(advantages, *(torch.zeros(len(new)) for _ in range(3)))  # what the loss reads of them
    return rloo.policy_loss(new, batch, values, rloo.Args(cliprange=cliprange, token_level_kl=per_token, **flags),
                            entropy)


def prompt_rows(n: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        letters = [LETTERS[i] for i in torch.randperm(len(LETTERS), generator=gen)[:4].tolist()]
        rows.append({"prompt": " ".join(letters) + " :", "target": letters[0]})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def hub_cache_repo(name: str) -> tuple[str, Path]:
    """A model id of the tests' own Hugging Face cache (HF_HUB_CACHE, set by conftest) and its folder there, for a
    test to put snapshots in as a download of them leaves them: `name` the test's own (its tmp_path's)."""
    return f"org/{name}", Path(os.environ["HF_HUB_CACHE"]) / f"models--org--{name}"


@functools.cache
def forked_interpreter() -> forked_python.Interpreter | None:
    """This pytest worker's server of forked interpreters (tests/forked_python.py), started at the first call; None
    where TESTS_FORK=0."""
    if os.environ.get("TESTS_FORK", "1") == "0":
        return None
    directory = tempfile.mkdtemp(prefix="forked-python-")
    interpreter = forked_python.Interpreter(directory, script_env())
    atexit.register(shutil.rmtree, directory, True)
    atexit.register(interpreter.close)
    return interpreter


def python() -> str:
    """The Python that the tests run the project's scripts with, as `python` would run them: a fork of a process that
    has imported the libraries (milliseconds instead of seconds per start), or sys.executable where TESTS_FORK=0."""
    interpreter = forked_interpreter()
    return interpreter.path if interpreter else sys.executable


def pid_of(process: subprocess.Popen) -> int:
    """The pid of the run a Popen of python() stands for (the one its lock file and messages name)."""
    interpreter = forked_interpreter()
    return interpreter.pid_of(process) if interpreter else process.pid


def script_command(script: str, *args, nproc: int = 0) -> list[str]:
    """`python SCRIPT ARGS`, or `torchrun --nproc_per_node NPROC SCRIPT ARGS`."""
    launcher = [python(), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)
                ] if nproc else [python()]
    return [*launcher, str(REPO / script), *map(str, args)]


# What the tests mean: the CPU, also on a machine with a GPU (two ranks cannot share one GPU); the GPU tests pass
# their own CUDA_VISIBLE_DEVICES.
ON_CPU = {"CUDA_VISIBLE_DEVICES": ""}


def cpu_env(env: dict | None = None) -> dict:
    """This process's environment for a subprocess that runs on the CPU, offline, plus `env`."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", **ON_CPU, **(env or {})}


def script_env(env: dict | None = None) -> dict:
    """The environment of a run: tests/ importable (reward functions), offline, on the CPU."""
    return cpu_env({"PYTHONPATH": str(REPO / "tests"), "WANDB_MODE": "offline", **(env or {})})


def run_rloo(*args: str, nproc: int = 0, env: dict | None = None, timeout: int = 300,
             script: str = "rloo.py") -> subprocess.CompletedProcess:
    """`python rloo.py ARGS`, or `torchrun --nproc_per_node NPROC rloo.py ARGS` (or another SCRIPT), to the end."""
    return subprocess.run(script_command(script, *args, nproc=nproc), capture_output=True, text=True,
                          env=script_env(env), timeout=timeout, cwd=REPO)


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def run_rloo_in_process(*args: str) -> None:
    """rloo.py ARGS in this process: its command line parsed as `python rloo.py` parses it, then rloo.main, pytest's
    signal handlers put back after. No imports paid again: for a test that needs the run's files, not its exit
    status or console (those need run_rloo)."""
    import plumbing
    import rloo

    saved = {sig: signal.getsignal(sig) for sig in plumbing.StopSignal.SIGNALS}
    try:
        rloo.main(plumbing.parse_args(rloo.Args, [str(a) for a in args], prog="rloo.py"))
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def free_port() -> int:
    """A port with nothing listening on it, nor on the one after it (an --engine_port's weight group), both outside the
    ephemeral range, where the runs' own outgoing connections would take them."""
    return rloo_multinode.free_engine_port()


def valid_flags(assets, output_dir: Path) -> dict:
    """A valid command, as {flag: value}."""
    return {"model_name_or_path": assets["policy"], "dataset_name": assets["train"], "output_dir": output_dir,
            "reward_fn": "reward_fns:count_a", "max_prompt_length": 16, "response_length": 6}


def argv_of(flags: dict) -> list[str]:
    return [s for name, value in flags.items() for s in (f"--{name}", *([] if value is None else [str(value)]))]


def left_padded(tokenizer, texts):
    return plumbing.pad_sequences([tokenizer(t)["input_ids"] for t in texts], tokenizer.pad_token_id,
                                  torch.device("cpu"))


def NO_AUTOCAST():
    return torch.autocast("cpu", enabled=False)


# ---------------------------------------------------------------- checkpoints: runs stopped, resumed and compared
RUN = ("--reward_fn", "reward_fns:count_a", "--rloo_k", "4", "--per_device_train_batch_size", "16",
       "--response_length", "6", "--temperature", "1.0", "--max_prompt_length", "16",
       "--local_rollout_forward_batch_size", "32", "--num_ppo_epochs", "2", "--num_mini_batches", "2",
       "--learning_rate", "3e-3", "--num_sample_generations", "0", "--num_evals", "3")
PER_UPDATE = 32  # completions per update and rank: 16 x 1 x 2 minibatches (8 prompts x k=4)
NOT_REPRODUCIBLE = ("eps", "time/", "run_id")  # wall-clock measurements, and each run's own id


def comparable(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith(NOT_REPRODUCIBLE)} for m in metrics]


def launch(args: list, nproc: int = 0, script: Path = REPO / "rloo.py", env: dict | None = None) -> subprocess.Popen:
    """`script` (rloo.py, or an edited copy elsewhere: the repository is on its path) with `args`, on `nproc` ranks,
    with `env`'s variables added."""
    launcher = [python(), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                "--signals_to_handle", "SIGTERM,SIGINT,SIGUSR1"] if nproc else [python()]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)]), "HF_HUB_OFFLINE": "1",
           "WANDB_MODE": "offline", **(env or {})}
    return subprocess.Popen([*launcher, str(script), *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)


def interrupt_after_first_update(args: list, sig: signal.Signals, nproc: int = 0,
                                 meanwhile: Callable = lambda process: None,
                                 script: Path = REPO / "rloo.py") -> tuple[int, str, str]:
    """Start a run, once it has logged an update call `meanwhile` and send it a real signal, wait for it to end."""
    process = launch(args, nproc, script)
    out = Path(args[args.index("--output_dir") + 1])
    wait_until(lambda: updates_logged(out) >= 1 or process.poll() is not None, what="an update logged")
    meanwhile(process)
    process.send_signal(sig)
    stdout, stderr = process.communicate(timeout=600)
    return process.returncode, stdout, stderr


def assert_same_run(full: Path, resumed: Path) -> None:
    run_id = json.loads((resumed / "args.json").read_text())["run_id"]  # the id drawn at the first start, kept
    assert {m["run_id"] for m in read_metrics(resumed)} == {run_id}
    assert comparable(read_metrics(resumed)) == comparable(read_metrics(full))
    a, b = load_file(full / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # bit-identical


def trainer_state(update: int, run_id: str = "run-a", **changes) -> dict:
    """A trainer state as Checkpointer.save writes it (the optimizer's is added by save_checkpoint)."""
    return {"update": update, "episode": update, "sampler": {"epoch": 0, "position": 0}, "elapsed": 0.0,
            "world_size": 1, "args": {}, "wandb_run_id": None, "run_id": run_id, "inputs": {}, **changes}


def saved_steps(out: Path, steps, keep=None, run_id: str = "run-a") -> tuple:
    """Checkpoints of a tiny policy at these steps in out/checkpoints, as a run writes them."""
    tokenizer = policy_tokenizer()
    policy = tiny_policy(len(tokenizer))
    optimizer = torch.optim.AdamW(policy.parameters())
    for step in steps:
        plumbing.checkpoints.save_checkpoint(str(out), step, policy, optimizer, tokenizer, trainer_state(step, run_id),
                                             0, keep, {})
    return policy, optimizer, tokenizer


def fake_run(out: Path, steps: list[int], run_id: str = "run-a") -> None:
    """What rloo.py leaves in output_dir, in outline: checkpoints, metrics, a final policy and its run record, and
    files of the user's (a plot, notes, a git checkout)."""
    for step in steps:
        (out / "checkpoints" / f"step_{step}").mkdir(parents=True)
        (out / "checkpoints" / f"step_{step}" / "manifest.json").write_text(json.dumps({"files": {}, "run_id": run_id}))
    lines = [json.dumps({"update": step, "run_id": run_id}) + "\n" for step in range(1, max(steps) + 1)]
    (out / "metrics.jsonl").write_text("".join(lines) + '{"update": 4, "objective/sc')  # the last one cut short
    policy_files = ["model.safetensors", "config.json", "tokenizer.json"]
    (out / "args.json").write_text(json.dumps({"run_id": run_id, "files": policy_files}))
    for name in policy_files + ["my_plot.png", "notes.txt"]:
        (out / name).write_text("{}")
    (out / ".git").mkdir()
    (out / ".git" / "HEAD").write_text("ref: refs/heads/main\n")


def forge_manifest(step: Path) -> None:
    """What a checkpoint made elsewhere can do: list its files, payload included, with their true hashes, under the run
    id and update its manifest named (none where it was unreadable)."""
    try:
        kept = {k: v for k, v in json.loads((step / "manifest.json").read_text()).items() if k != "files"}
    except (OSError, ValueError, AttributeError):
        kept = {}
    (step / "manifest.json").unlink(missing_ok=True)
    (step / "manifest.json").write_text(json.dumps({"files": plumbing.checkpoints.file_digests(step), **kept}))


def tree(root: Path) -> dict[str, bytes]:
    """Every file under root (but the lock) with its bytes: what a run may not have changed."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.is_symlink() and p.name != plumbing.LOCK}


# ---------------------------------------------------------------- the update: completions sampled and trained on
UNEVEN_PROMPTS = ["a b c d e f :", "g :", "h i :"]  # 3 prompts of 7, 2 and 3 tokens


def eos_prone_policy(seed: int = 0, attention: str = "sdpa") -> tuple[PreTrainedTokenizerFast, GPTNeoXForCausalLM]:
    """A tiny policy whose EOS (id 1) is likely, so that completions end at different lengths."""
    tokenizer = policy_tokenizer()
    policy = tiny_policy(len(tokenizer), seed=seed)
    policy.set_attn_implementation(attention)
    with torch.no_grad():
        policy.get_output_embeddings().weight[1] *= 3
    return tokenizer, policy


def sampled(k: int, attention: str = "sdpa", seed: int = 0) -> tuple[torch.nn.Module, rloo.Completions]:
    tokenizer, policy = eos_prone_policy(attention=attention)
    queries, query_mask = plumbing.pad_sequences([tokenizer(p)["input_ids"] for p in UNEVEN_PROMPTS], 0,
                                                 torch.device("cpu"))
    c = rloo.sample_completions(policy, queries, query_mask, 6, 1.0, 1, 0, torch.Generator().manual_seed(seed), k=k)
    assert len(set(c.response_mask.sum(1).tolist())) > 1  # responses of several lengths
    return policy, c


def trained(share_prompt: bool, c: rloo.Completions, logprobs_from_update: bool, **flags) -> dict:
    """Parameters after a ppo_update from the same start and the same random draws."""
    k = c.k
    policy = tiny_policy(len(policy_tokenizer()), seed=3)
    args = rloo.Args(rloo_k=k, temperature=1.0, kl_coef=0.1, **flags)
    sizes = rloo.compute_batch_sizes(args, 1)
    with torch.no_grad():
        ref, _ = rloo.forward_logprobs(tiny_policy(len(policy_tokenizer()), seed=4), c, 1.0, share_prompt)
        logprobs = None if logprobs_from_update else \
            rloo.forward_logprobs(policy, c, 1.0, share_prompt)[0] * c.response_mask
    rollout = rloo.Rollout(c.queries, c.query_mask, c.responses, c.response_mask, logprobs, ref * c.response_mask)
    scores = torch.randn(c.responses.shape[0], generator=torch.Generator().manual_seed(2))
    torch.manual_seed(7)
    stats, _ = rloo.ppo_update(policy, torch.optim.SGD(policy.parameters(), lr=1.0), rollout, scores, args, sizes,
                               share_prompt, NO_AUTOCAST)
    return {"stats": stats, "logprobs": rollout.logprobs, **{n: p.detach() for n, p in policy.named_parameters()}}


# ---------------------------------------------------------------- changing the algorithm: a module's main, in process
K, PROMPTS = 4, 4  # 16 completions an update


def run_main(module, in_update: list | None = None, **flags) -> list:
    """module.main in this process with the tiny policy's flags and these; the rollouts it trained on (and in
    `in_update`, whether the update's forward gave each one's log-probs)."""
    rollouts, collect = [], module.collect_rollout

    def collect_and_keep(*args, **kwargs):
        rollouts.append(collect(*args, **kwargs))  # ppo_update fills it on-policy: final once the update is done
        if in_update is not None:
            in_update.append(args[5])
        return rollouts[-1]

    module.collect_rollout = collect_and_keep
    try:
        module.main(module.Args(**{"reward_fn": ["reward_fns:count_a"], "max_prompt_length": 16, "response_length": 6,
                                   "rloo_k": K, "per_device_train_batch_size": K * PROMPTS, "temperature": 1.0,
                                   "num_sample_generations": 0, "learning_rate": 3e-3,
                                   "lr_scheduler_type": "constant"} | flags))
    finally:
        module.collect_rollout = collect
    return rollouts


# ---------------------------------------------------------------- a changed algorithm: edited copies of rloo.py, trained
def edited_rloo(diffs: list[str], tmp_path, name: str = "rloo.py"):
    """rloo.py with the diffs applied (each one's context and removed lines found exactly once: the README's and
    docs/algorithm.md's worked examples, or a test's own), imported as a module (its file tmp_path/name)."""
    source = (REPO / "rloo.py").read_text()
    for diff in (hunk for block in diffs for hunk in re.split(r"^@@.*\n", block, flags=re.M)):  # @@: a new hunk
        lines = diff.splitlines()
        old = "".join(line[1:] + "\n" for line in lines if line[:1] in (" ", "-"))
        new = "".join(line[1:] + "\n" for line in lines if line[:1] in (" ", "+"))
        if source.count(old) != 1:
            stock_text_differs(f"an example's lines are in rloo.py {source.count(old)} times, not once: "
                               f"{old.strip().splitlines()[0]!r}")
        source = source.replace(old, new)
    path = tmp_path / name
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"rloo_edited_{tmp_path.name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def train(module, updates: int, score, **flags) -> tuple[torch.nn.Module, list]:
    """`updates` updates of the tiny policy on 4 prompts x 4 completions with module's functions as main calls them:
    sample, log-probs (unless the update computes them: on-policy settings, from the second update on, once the first
    found compute_advantages the same apart; the reference's with kl_coef > 0), score(completions), which count in
    the loss, ppo_update. Returns the policy and each update's (rollout, stats, the Advantages it trained on)."""
    tokenizer = policy_tokenizer()
    policy = tiny_policy(len(tokenizer), seed=0)
    reference = tiny_policy(len(tokenizer), seed=0).requires_grad_(False) if flags.get("kl_coef") else None
    args = module.Args(**{"rloo_k": K, "per_device_train_batch_size": K * PROMPTS, "num_ppo_epochs": 1,
                          "temperature": 1.0, "response_length": 5, "kl_coef": 0.0,
                          "local_rollout_forward_batch_size": K * PROMPTS} | flags)
    sizes = module.compute_batch_sizes(args, 1)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.5)
    generator = torch.Generator().manual_seed(0)
    rows = prompt_rows(PROMPTS * updates, seed=3)
    history, state = [], module.AlgorithmState.start(args, len(rows))
    shortcut, in_update = module.logprobs_from_update(args, sizes, 0), False
    for update in range(updates):
        queries, query_mask = left_padded(tokenizer, [r["prompt"] for r in rows[update * PROMPTS:][:PROMPTS]])
        c = replace(module.sample_completions(policy, queries, query_mask, args.response_length, 1.0, 1, 0, generator,
                                              k=K, filters=module.SamplingFilters.of(args)),
                    prompt_index=torch.arange(update * PROMPTS, (update + 1) * PROMPTS))  # their rows of `rows`
        rollout = module.collect_rollout(policy, reference, c, args, True, in_update, NO_AUTOCAST,
                                         plumbing.PhaseTimer(torch.device("cpu")))
        scores = score(c)  # (k*B,)
        rollout.in_loss = module.completions_in_loss(scores, rollout.ended(1), args)
        torch.manual_seed(update)
        stats, values = module.ppo_update(policy, optimizer, rollout, scores, args, sizes, True, NO_AUTOCAST,
                                          state=state)
        if shortcut and not in_update:  # as main decides it
            in_update = shortcut = module.advantages_apart(rollout, scores, values, args, sizes, state) is None
        history.append((rollout, stats, values))
    return policy, history


@functools.cache
def reward_model() -> torch.nn.Module:
    return tiny_reward_model(len(policy_tokenizer()))


def reward_model_score(c) -> torch.Tensor:
    """(k*B,) 10 x a tiny reward model's scores of the completions: groups with a spread of rewards."""
    return 10 * rloo.reward_model_scores(reward_model(), c, True)


TWO_RANKS = ["--reward_fn", "reward_fns:count_a", "--rloo_k", "4", "--per_device_train_batch_size", "16",
             "--response_length", "6", "--temperature", "1.0", "--max_prompt_length", "16", "--num_ppo_epochs", "2",
             "--learning_rate", "3e-3", "--num_sample_generations", "0", "--total_episodes", 4 * 16 * 2]  # 4 updates


def stopped_and_resumed_on_two_ranks(module, assets, tmp_path, *flags) -> Path:
    """The edited rloo.py (`module`'s file) trained for 4 updates on two ranks (torchrun, gloo, CPU), and again
    stopped by SIGTERM after an update and resumed: the same metrics and bit-identical weights. Returns the
    resumed run's output_dir."""
    script = Path(module.__file__)
    common = ["--model_name_or_path", assets["policy"], "--dataset_name", assets["train"], *TWO_RANKS, *flags]
    env = {"PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)])}
    full, stopped = tmp_path / "full", tmp_path / "stopped"
    result = run_rloo(*common, "--output_dir", full, nproc=2, env=env, script=str(script))
    assert result.returncode == 0, result.stderr[-3000:]
    _, stdout, stderr = interrupt_after_first_update([*common, "--output_dir", stopped], signal.SIGTERM, 2,
                                                     script=script)
    assert "SIGTERM received" in stdout and not (stopped / "model.safetensors").exists(), stdout + stderr[-3000:]
    result = run_rloo(*common, "--output_dir", stopped, "--resume", nproc=2, env=env, script=str(script))
    assert result.returncode == 0 and "resuming from" in result.stdout, result.stderr[-3000:]
    assert_same_run(full, stopped)
    return stopped


# ---------------------------------------------------------------- engines (rloo_multinode.py): runs, sockets, processes
# RUN but for --local_rollout_forward_batch_size 12 and --num_evals 0; PER_UPDATE completions per update and rank
ENGINE_RUN = ("--reward_fn", "reward_fns:count_a", "--rloo_k", "4", "--per_device_train_batch_size", "16",
              "--response_length", "6", "--temperature", "1.0", "--max_prompt_length", "16",
              "--local_rollout_forward_batch_size", "12", "--num_ppo_epochs", "2", "--num_mini_batches", "2",
              "--learning_rate", "3e-3", "--num_sample_generations", "0", "--num_evals", "0")
ENGINE_ONLY = ("time/", "eps", "rollout/staleness", "work/", "run_id")  # wall-clock, what only the engines' run
# measures, the trainer's own forward passes (the local run also generates), and each run's own id
SECRET = "tests-secret-" + "0" * 32  # a run's control-store secret, as a user exports it


def run_script(script: str, *args, nproc: int = 0, wait: bool = True,
               env: dict | None = None) -> subprocess.CompletedProcess | subprocess.Popen:
    """The script run to the end, or with wait=False started and returned running."""
    if wait:
        return run_rloo(*args, nproc=nproc, script=script, env=env)
    return subprocess.Popen(script_command(script, *args, nproc=nproc), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=script_env(env), cwd=REPO)


def wait_until(ready: Callable[[], bool], process: subprocess.Popen | None = None, what: str = "the event",
               log: Path | None = None) -> None:
    """Until ready() holds, looked at every 50 ms: the tests wait for events, never for seconds. A failure if
    `process` exits first, with the end of its stderr (piped, or written to `log`); or after 600 s, a hang guard."""
    deadline = time.monotonic() + 600
    while not ready():
        if process is not None and process.poll() is not None:
            stderr = log.read_text() if log is not None else process.communicate()[1] if process.stderr else ""
            raise AssertionError(f"the process exited ({process.returncode}) before {what}: {stderr[-3000:]}")
        assert time.monotonic() < deadline, f"{what}: not within 600 s, a hang guard"
        time.sleep(0.05)


def updates_logged(out: Path) -> int:
    """How many updates a run has logged to out/metrics.jsonl so far, read as plumbing reads it: the evaluations'
    lines left out (the initial policy's comes before the first update), and a line still being written."""
    return len(plumbing.runlog.read_metrics(out / "metrics.jsonl")) if (out / "metrics.jsonl").is_file() else 0


def wait_for_updates(trainer: subprocess.Popen, out: Path, count: int) -> None:
    """Until the running trainer has logged `count` updates to out/metrics.jsonl; a failure if it exits first."""
    wait_until(lambda: updates_logged(out) >= count, trainer, f"{count} updates logged")


def engine_comparable(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith(ENGINE_ONLY)} for m in metrics]


def ip_address(hex_address: str) -> str:
    """An address as /proc/net/tcp(6) writes it (32-bit words in host order, little-endian here), as text."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, words)


def listening_sockets(pids: list[int]) -> dict[int, tuple[str, int]]:
    """Every listening TCP socket the processes hold: {inode: (address, port)}."""
    inodes = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:["):
                        inodes.add(int(target[len("socket:[") : -1]))
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and int(fields[9]) in inodes:  # 0A: LISTEN
                address, port = fields[1].rsplit(":", 1)
                found[int(fields[9])] = (ip_address(address), int(port, 16))
    return found


def live_processes_in_group(pgid: int) -> list[int]:
    """The pids of the process group's members that still run (zombies, which nobody may reap here, excluded)."""
    pids = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError):
            state, _, group = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:3]  # after "pid (comm)"
            if state != "Z" and int(group) == pgid:
                pids.append(int(entry.name))
    return pids


# ---------------------------------------------------------------- vLLM engines: their log-probs against the trainer's
def fixed_sequences() -> list[list[int]]:
    """Prompts and completions written out as token ids (letters, ':', EOS), of different lengths."""
    tokenizer = policy_tokenizer()
    texts = ["a b c d : a b", "l k : l k l <eos>", "e f g h i j : e f g h i j e f", "c :"]
    return [tokenizer(text)["input_ids"] for text in texts]


@torch.no_grad()
def trainer_logprobs(policy, sequences: list[list[int]]) -> list[list[float]]:
    """The trainer's log p(token t | tokens < t), t >= 1, by a plain forward of the policy."""
    out = []
    for ids in sequences:
        ids = torch.tensor([ids])  # (1, T)
        logp = torch.log_softmax(policy(ids).logits.float(), -1)[0, :-1]  # (T-1, V)
        out.append(logp.gather(-1, ids[0, 1:, None])[:, 0].tolist())
    return out


def max_difference(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(x) for x in b]
    return max(abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


# ---------------------------------------------------------------- the benchmark scripts
def run_benchmark_script(*args) -> None:
    """A benchmark script to the end, its OpenMP threads sleeping when idle instead of spinning (as `make test` sets
    for all tests): on a busy 2-core machine the spinning made these runs several times slower. Same results."""
    result = subprocess.run([python(), *map(str, args)], capture_output=True, text=True, cwd=REPO, timeout=600,
                            env=cpu_env({"OMP_WAIT_POLICY": "PASSIVE"}))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


# ---------------------------------------------------------------- TRL 1.16's run of a recipe (tests/test_trl116_run.py)
TRL116_TABLE = json.loads((REPO / "plumbing" / "trl116_defaults.json").read_text())["fields"]["RLOOConfig"]

TRL116_RECIPES = [  # TRL 1.16's flags, and the prompts the recipe trains on
    ({"num_generations": 4, "per_device_train_batch_size": 8, "max_steps": 6, "learning_rate": 1e-3}, 44),
    ({"num_generations": 4, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
      "steps_per_generation": 4, "max_steps": 7, "warmup_steps": 2, "lr_scheduler_type": "constant_with_warmup",
      "learning_rate": 1e-3}, 44),
    ({"num_generations": 2, "per_device_train_batch_size": 4, "num_iterations": 2, "max_steps": 5, "save_steps": 2,
      "logging_steps": 3}, 19),
    ({"num_generations": 4, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 2,
      "steps_per_generation": 4, "num_train_epochs": 2, "save_steps": 4}, 44),
    ({"num_generations": 4, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 2,
      "steps_per_generation": 4, "num_train_epochs": 1.5, "logging_steps": 0.2, "warmup_steps": 0.1}, 44),
    ({"num_generations": 2, "per_device_train_batch_size": 4, "steps_per_generation": 2, "num_iterations": 2,
      "num_train_epochs": 1, "lr_scheduler_type": "cosine"}, 19),
    ({"num_generations": 4, "per_device_train_batch_size": 4, "generation_batch_size": 16, "num_iterations": 2,
      "num_train_epochs": 0.7, "warmup_steps": 0.2, "lr_scheduler_type": "cosine", "learning_rate": 1e-4}, 45),
    ({"num_generations": 2, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
      "eval_strategy": "steps", "eval_steps": 4, "save_steps": 4, "logging_steps": 2}, 13),
]


def trl116_run(recipe: dict, num_prompts: int, tmp_path, world_size: int = 1) -> dict:
    """TRL 1.16's run of a recipe on `num_prompts` prompts, from the committed table of its RLOOConfig's defaults and
    TRL's own arithmetic (its RLOOConfig's generation batch, its RepeatSampler's length, _prepare_inputs' generations;
    tests/trl116_run_length.py checks these against TRL 1.16 itself) and the installed transformers' own Trainer code:
    its optimizer steps, generations (rloo.py's updates) and completions, the learning rate of each optimizer step, the
    steps that log, save and evaluate, its bf16, gradient checkpointing and seed."""
    from types import SimpleNamespace

    from transformers import Trainer, TrainerControl, TrainerState, TrainingArguments, get_scheduler
    from transformers.trainer_callback import DefaultFlowCallback

    c = TRL116_TABLE | recipe
    micro, accumulation, k = c["per_device_train_batch_size"], c["gradient_accumulation_steps"], c["num_generations"]
    per_generation, generation_batch = c["steps_per_generation"], c["generation_batch_size"]
    if per_generation is None and generation_batch is None:  # RLOOConfig.__post_init__
        per_generation = accumulation
        generation_batch = micro * world_size * per_generation
    elif per_generation is None:
        per_generation = generation_batch // (micro * world_size)
    else:
        generation_batch = micro * world_size * per_generation
    generate_every = per_generation * c["num_iterations"]  # RLOOTrainer._prepare_inputs
    # RepeatSampler(mini_repeat_count=k, batch_size=generation_batch // k, repeat_count=generate_every): whole batches
    # of prompts only, each prompt k times, each batch generate_every times; the dataloader's batches of micro x
    # steps_per_generation completions per process
    prompts_per_batch = generation_batch // k
    samples = num_prompts // prompts_per_batch * prompts_per_batch * k * generate_every
    batches = samples // (micro * per_generation * world_size)
    args = TrainingArguments(
        output_dir=str(tmp_path / "trl"), use_cpu=True, report_to="none", per_device_train_batch_size=micro,
        gradient_accumulation_steps=accumulation, num_train_epochs=c["num_train_epochs"], max_steps=c["max_steps"],
        learning_rate=c["learning_rate"], lr_scheduler_type=c["lr_scheduler_type"], warmup_steps=c["warmup_steps"],
        logging_steps=c["logging_steps"], save_steps=c["save_steps"], eval_strategy=c["eval_strategy"],
        eval_steps=c["eval_steps"])
    trainer = SimpleNamespace(get_total_train_batch_size=lambda _: micro * accumulation * world_size,
                              get_sp_size=lambda: 1, num_examples=lambda _: samples)
    max_steps = Trainer.set_initial_training_values(trainer, args, range(batches))[-1]
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=args.learning_rate)
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=args.get_warmup_steps(max_steps),
                              num_training_steps=max_steps)  # Trainer.create_scheduler
    state, flow, rates, acts = TrainerState(max_steps=max_steps), DefaultFlowCallback(), [], {}
    state.compute_steps(args, max_steps)
    for step in range(1, max_steps + 1):  # the Trainer's loop: the rate of the step, then the scheduler's step
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
        state.global_step, control = step, TrainerControl()
        flow.on_step_end(args, state, control)
        for act in ("log", "save", "evaluate"):
            if getattr(control, f"should_{act}"):
                acts.setdefault(act, []).append(step)
    generations = sum(step % generate_every == 0 for step in range(max_steps * accumulation))  # TRL's _step
    bf16 = (c["bf16"] if c["bf16"] is not None else not c["fp16"]) and torch.cuda.is_available()  # where it can be
    return {"steps": max_steps, "updates": generations, "completions": generations * generation_batch,
            "steps_per_update": generate_every // accumulation, "rates": rates, "log": acts.get("log", []),
            "save": acts.get("save", []), "evaluate": acts.get("evaluate", []), "bf16": bf16,
            "gradient_checkpointing": c["gradient_checkpointing"], "seed": c["seed"], "samples": samples,
            "steps_per_generation": per_generation, "generation_batch_size": generation_batch}



# ---------------------------------------------------------------- the Makefile
def planned_commands(target: str, env_dir, **variables) -> list[str]:
    """The commands `make TARGET` would run (make -n), with the environment at env_dir and no active one."""
    environment = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "CONDA_PREFIX", "MAKEFLAGS")}
    overrides = [f"{k}={v}" for k, v in {"ENV": env_dir, **variables}.items()]
    result = subprocess.run(["make", "-n", "-C", str(REPO), target, *overrides], capture_output=True, text=True,
                            env=environment)
    assert result.returncode == 0, result.stderr
    return [line for line in result.stdout.splitlines() if not line.startswith("make")]


def position(commands: list[str], pattern: str) -> int:
    matches = [i for i, c in enumerate(commands) if re.search(pattern, c)]
    assert matches, (pattern, commands)
    return matches[0]
