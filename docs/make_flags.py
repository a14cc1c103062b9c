"""Writes docs/flags.md from the `Args` docstrings of rloo.py and rloo_multinode.py (and of plumbing.RunArgs and
InputArgs, which rloo.py's Args extends), so a flag is written once.

    python docs/make_flags.py            # rewrites docs/flags.md
    python docs/make_flags.py --check    # exit status 1 when docs/flags.md is not what this script writes

A table per group: the groups are the `# ----- name -----` comments in each `Args` class's source, in order, the inputs
(plumbing.InputArgs) first, the run's (plumbing.RunArgs) last; a subclass's own fields (rloo_multinode.py's engine flags) get groups of their own, named with
its file. A field whose type is a dataclass is a group too (its flags keep their own names). Only the project and the
standard library are imported.
"""

import ast
import dataclasses
import inspect
import re
import sys
import textwrap
import typing
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # rloo.py and rloo_multinode.py are scripts at the top level, not a package

import plumbing  # noqa: E402
import rloo  # noqa: E402
import rloo_multinode  # noqa: E402

FLAGS_MD = REPO / "docs" / "flags.md"
GROUP = re.compile(r"#\s*-{3,}\s*(.+?)\s*-{3,}\s*$")

HEADER = """# Flags

<!-- written by docs/make_flags.py from the Args docstrings: edit a flag's docstring, then run
     python docs/make_flags.py (tests/test_docs.py checks that this file is what it writes) -->

Every flag of `rloo.py` and `rloo_multinode.py`, grouped as in their `Args` dataclasses, with the docstring under
each field, which `python rloo.py --help` prints too. Flags take `--rloo_k 4` and `--rloo-k 4` alike; booleans are
switches (`--bf16`, `--no-bf16`); a list flag takes several values (`--reward_fn a:f b:g`). What a description
leaves out of a flag is in [flag-notes.md](flag-notes.md).
"""

TRL_INTRO = """## TRL's names

The flags are TRL <= 0.21's `RLOOConfig` names, so published commands run unchanged. TRL 0.22 renamed several;
where the new name means exactly what rloo.py's flag means, rloo.py accepts it too, as a tyro alias (`--help` lists
it beside the flag). The algorithm's flags left out take TRL <= 0.21's defaults (`--num_iterations` left out is 4 PPO
epochs), or with `--trl_defaults 1.16` TRL 1.16's (1); a command in TRL >= 0.22's names is told which in one line at
start-up ([flag-notes.md](flag-notes.md#--trl_defaults)). A flag given twice, under one name or both, takes the last value
(argparse's rule, which the TL;DR scripts rely on: their extra arguments override their defaults), but a list flag
given twice keeps every value (`--reward_fn a:f --reward_fn b:g` is `--reward_fn a:f b:g`).

| TRL <= 0.21 = rloo.py | TRL >= 0.22 | here |
| --- | --- | --- |
"""

TRL_REFUSED_INTRO = """TRL 1.16's other flags (its `RLOOConfig`, the `TrainingArguments` it inherits, the `trl rloo`
script's) mean nothing here, or what rloo.py always does: each is accepted with the values that say what rloo.py does,
and otherwise refused in one line with the reason below (exit status 2), before anything loads. Any `trl rloo` flag
given at TRL 1.16's own default is accepted: it asks for nothing the user chose (`--fp16 False`, `--push_to_hub
False`, `--per_device_eval_batch_size 8`); where rloo.py has the flag, TRL's default is taken with TRL's meaning, and
TRL's "not set" (`--max_steps -1`, `None`) leaves rloo.py's default. TRL's defaults are read from
`plumbing/trl116_defaults.json`, written from TRL 1.16's dataclasses by `benchmark/trl116_defaults.py` (a test
compares the two). The `trl` command's own launcher options (`--num_processes`, `--accelerate_config`, ...) are
refused naming torchrun. `tests/test_trl_parity.py` holds TRL 1.16's whole field list against both scripts.

| TRL flag | accepted values | why |
| --- | --- | --- |
"""

# What TRL's names mean beside rloo.py's flags, said here once; TRL 1.16's defaults from plumbing.TRL116
TRL_NOTES = {
    "num_generations": "",
    "beta": " (sequence-level KL in the reward)",
    "epsilon": " (the low side of the clip; `--epsilon_high`, as TRL's, the high side)",
    "num_iterations": f" (TRL's default is {plumbing.TRL116['num_iterations']}, rloo.py's {{default}})",
    "max_completion_length": f" (TRL 1.16's default is {plumbing.TRL116['max_completion_length']}, rloo.py's "
                             "{default})",
    "normalize_advantages": ": both whiten the advantages over the batch",
    "reward_model_name_or_path": " (the `trl rloo` script's name)",
    "activation_checkpointing": " (transformers 5.23's name)",
}

TRL_OTHER_ROWS = [  # (rloo.py's name, TRL >= 0.22's, what rloo.py does with it)
    ("`--num_mini_batches`", "`--steps_per_generation`",
     "converted: TRL counts micro-batches per generation, rloo.py optimizer steps, so `--steps_per_generation S` is "
     "taken as `--num_mini_batches S / gradient_accumulation_steps` (refused when it does not divide)"),
    ("`--normalize_reward`", "(TRL maps it to `--normalize_advantages`)",
     "not the same: rloo.py's standardizes the scores before the baseline, TRL's new flag normalizes advantages"),
    ("`--exp_name`", "`--run_name`",
     "not the same: TRL's is the whole run name, rloo.py's a prefix of `{exp_name}__{seed}__{time}`; rloo.py has "
     "`--run_name` too, with TRL's meaning"),
    ("`--total_episodes`", "`--max_steps`",
     "both accepted (one of them): `--max_steps` counts optimizer steps, as TRL's Trainer does, a multiple of an "
     "update's `num_ppo_epochs x num_mini_batches`"),
    ("`--reward_fn pkg.module:fn`", "`--reward_funcs pkg.module.fn` (the `trl rloo` script's)",
     "converted: the dotted path's last dot becomes the colon; TRL's built-in names (`accuracy_reward`) are refused"),
    ("`--track`, `--tensorboard`", "`--report_to wandb`, `tensorboard` (both, or `none`)",
     "converted; any other logger is refused (metrics.jsonl is always written); TensorBoard needs `pip install "
     "tensorboard`, refused in one line without it"),
    ("`--config FILE.yaml`", "`--config FILE.yaml` (the `trl` command's)",
     "the same format: a mapping of flag names to values, TRL's names and rloo.py's alike; a flag on the command "
     "line wins over the file's, under either name; an unknown key, an `env:` section, a launcher key or one flag "
     "under two of its names is one line naming the file"),
    ("`--num_train_epochs`", "`--num_train_epochs`",
     "TRL 1.16's meaning: passes over the prompts, each sampled k times (`num_train_epochs x prompts x k` episodes); "
     "TRL <= 0.21 counted `num_train_epochs x prompts` episodes, 1/k of it. The start-up line says what an epoch is "
     "in prompts, completions and updates"),
    ("`--weight_decay`", "`--weight_decay`",
     "TRL's default (0.0, both TRLs) and meaning: every trained weight decays but biases and norms, as transformers' "
     "Trainer groups them. Before the flag, rloo.py's AdamW decayed every weight by torch's 0.01"),
    ("`--eval_strategy`, `--eval_steps`", "`--eval_strategy`, `--eval_steps`",
     "TRL's meaning (`no`, `steps` every `--eval_steps`, else `--logging_steps`; `epoch`), with TRL's `test` split "
     "when `--dataset_test_split` is not given; left out, rloo.py evaluates `--num_evals` times when "
     "`--dataset_test_split` is given"),
    ("`--mask_truncated_completions`", "`--mask_truncated_completions`",
     "TRL's meaning: a completion without the stop token leaves the loss and its KL leaves its reward, which stays in "
     "its group's baselines (checked against TRL 1.16's code on the same batch)"),
    ("reward functions' `None`", "reward functions' `None`",
     "TRL's meaning: a completion no source scores is left out of its group's baselines, with advantage 0 (so is "
     "the only scored completion of a group)"),
    ("`--resume_from DIR` / `--resume`", "`--resume_from_checkpoint DIR` / `True`", "converted"),
    ("`--fsdp`", "`--fsdp \"full_shard auto_wrap\"`", "converted (FSDP2 shards as full_shard); other modes refused"),
    ("`--flag` / `--no-flag`", "`--flag True` / `--flag False`", "converted, for every switch"),
    ("`--save_steps`, `--logging_steps`", "`--save_steps`, `--logging_steps`",
     "same names, counted in updates (TRL <= 0.21's unit); in a command with `--max_steps`, in optimizer steps "
     "as TRL >= 0.22 counts them (`--save_steps` then a multiple of an update's steps); below 1, a share of the "
     "run's updates, as TRL's; `--logging_steps` spaces the console line, metrics.jsonl gets every update; "
     "`--save_strategy no` is `--save_steps 0`"),
    ("`rloo_multinode.py`'s `--engine vllm`, `--engine_urls`, `--engine_timeout`",
     "`--use_vllm`, `--vllm_server_base_url` (or `--vllm_server_host` and `--vllm_server_port`), "
     "`--vllm_server_timeout`",
     "converted by rloo_multinode.py; `--vllm_mode` is the same flag there (its default is server, TRL's colocate: "
     "`--use_vllm` without `--vllm_mode` is colocate, as in TRL); rloo.py, which has no engines, refuses them "
     "naming rloo_multinode.py"),
    ("`--reward_clip_range` (a float)", "`--reward_clip_range` (a `(min, max)` pair)",
     "same name, other meaning: rloo.py clips normalized scores to +-value, TRL clips rewards to a range"),
    ("`--max_prompt_length`", "`--max_prompt_length`",
     "same name, other meaning: rloo.py drops longer prompts, TRL truncates them on the left"),
    ("`--stop_token`, `--stop_token_id`, `--missing_eos_penalty`, `--token_level_kl`, "
     "`--local_rollout_forward_batch_size`, `--num_sample_generations`", "removed in TRL 0.22", "kept"),
]


@dataclasses.dataclass
class Flag:
    name: str
    default: str
    doc: str


def one_line(doc: str) -> str:
    """A docstring as one table cell: its lines joined, `|` escaped, `<x>` kept visible."""
    text = " ".join(line.strip() for line in inspect.cleandoc(doc).splitlines() if line.strip())
    return text.replace("|", "\\|").replace("<", "&lt;")


def default_of(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        return f"`{field.default}`"
    if field.default_factory is not dataclasses.MISSING:
        return f"`{field.default_factory()}`"
    return "required"


def own_fields(cls: type) -> list[tuple[str, str, str]]:
    """(group, field name, docstring) of the fields `cls` itself declares, in source order."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    body = next(node for node in ast.parse(source).body if isinstance(node, ast.ClassDef))
    out, group = [], ""
    statements = body.body
    for i, node in enumerate(statements):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        previous = statements[i - 1].end_lineno if i else body.lineno
        for line in lines[previous:node.lineno - 1]:  # the comment lines between the last statement and this one
            if match := GROUP.search(line.strip()):
                group = match.group(1)
        after = statements[i + 1] if i + 1 < len(statements) else None
        doc = (after.value.value if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
               and isinstance(after.value.value, str) else "")
        out.append((group, node.target.id, doc))
    return out


def groups_of(cls: type, title: str = "") -> dict[str, list[Flag]]:
    """Group title -> flags, for `cls` and the dataclasses it extends or holds, base classes first."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    try:
        types = typing.get_type_hints(cls)
    except (NameError, TypeError):  # an annotation that does not evaluate here: no nested dataclass is found in it
        types = {}
    groups: dict[str, list[Flag]] = {}
    # base classes first, but plumbing.RunArgs (the run's flags, not the algorithm's) last, as --help lists them
    bases = sorted((base for base in reversed(cls.__mro__) if dataclasses.is_dataclass(base)),
                   key=lambda base: base is plumbing.RunArgs)
    for base in bases:
        file = Path(inspect.getfile(base)).name
        shared = file == "rloo.py" or base.__module__.startswith("plumbing.")  # rloo.py's and what extends it
        suffix = f" (`{file}` only)" if not shared and base is not bases[0] else ""
        for group, name, doc in own_fields(base):
            if name not in fields:  # a ClassVar
                continue
            for flags in groups.values():  # a field a subclass declares again: its own docstring and group
                flags[:] = [flag for flag in flags if flag.name != name]
            kind = types.get(name, fields[name].type)
            if isinstance(kind, type) and dataclasses.is_dataclass(kind):
                for sub, flags in groups_of(kind, title=one_line(doc) or name).items():
                    groups.setdefault(sub + suffix, []).extend(flags)
                continue
            heading = (group[:1].upper() + group[1:] if group else title or f"`{base.__name__}`") + suffix
            groups.setdefault(heading, []).append(Flag(name, default_of(fields[name]), one_line(doc)))
    return {heading: flags for heading, flags in groups.items() if flags}


def table(flags: list[Flag]) -> str:
    rows = [f"| `--{f.name}` | {f.default} | {f.doc} |" for f in flags]
    return "\n".join(["| flag | default | meaning |", "| --- | --- | --- |", *rows]) + "\n"


def trl_section() -> str:
    defaults = {flag.name: flag.default for flags in groups_of(rloo.Args).values() for flag in flags}
    rows = []
    for trl_name, own in plumbing.TRL_NAMES.items():
        note = TRL_NOTES.get(trl_name, "").format(default=defaults[own])
        same = "accepted" + (note if note.startswith(":") else ", same meaning" + note)
        rows.append(f"| `--{own}` | `--{trl_name}` | {same} |")
    rows += [f"| {own} | {trl} | {here} |" for own, trl, here in TRL_OTHER_ROWS]
    refused = [f"| `--{name}` | {' or '.join(f'`{v}`' for v in values)} | {reason or 'no effect: text only'} |"
               for name, (values, reason) in sorted(plumbing.TRL_FIXED.items())]
    refused += [f"| `--{name}` | none | {reason} |" for name, reason in sorted(plumbing.TRL_REFUSED.items())]
    return TRL_INTRO + "\n".join(rows) + "\n\n" + TRL_REFUSED_INTRO + "\n".join(refused) + "\n"


def render() -> str:
    parts = [HEADER, trl_section()]
    for heading, flags in groups_of(rloo_multinode.Args).items():
        parts.append(f"## {heading}\n\n{table(flags)}")
    serve = getattr(rloo_multinode, "ServeArgs", None)
    if serve is not None:
        intro = one_line(serve.__doc__ or "")
        flags = [flag for group in groups_of(serve).values() for flag in group]
        parts.append(f"## `rloo_multinode.py serve`\n\n{intro}\n\n{table(flags)}")
    return "\n".join(parts)


def main(check: bool = False) -> None:
    """Write docs/flags.md from the Args docstrings.

    Args:
        check: write nothing; exit status 1 when docs/flags.md is not what this script writes.
    """
    text = render()
    plumbing.write_generated(FLAGS_MD, text, check, f"wrote {FLAGS_MD.relative_to(REPO)}: {text.count(chr(10))} lines")


if __name__ == "__main__":
    plumbing.run_tool("make_flags.py", main)
