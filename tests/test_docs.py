"""The documentation: every flag and every metric of rloo.py and rloo_multinode.py explained, docs/flags.md written
from the Args docstrings, a README of one screen per question, and no link to a file or heading that is not there."""

import dataclasses
import importlib.util
import inspect
import re
import shutil

import pytest

import plumbing
import rloo
import rloo_multinode
from conftest import REPO
from helpers import stock_text_differs

DOCS = REPO / "docs"
README_MAX_LINES = 300  # the sampling worked example and the GPU section


def make_flags():
    spec = importlib.util.spec_from_file_location("make_flags", DOCS / "make_flags.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def flag_fields(cls) -> list[dataclasses.Field]:
    """Every field that is a flag: those of nested dataclasses too (their flags keep their own names)."""
    out = []
    for f in dataclasses.fields(cls):
        out += flag_fields(f.type) if dataclasses.is_dataclass(f.type) else [f]
    return out


def test_flags_md_is_what_make_flags_writes():
    """A new flag is written once, in its docstring: `python docs/make_flags.py` rewrites docs/flags.md."""
    assert (DOCS / "flags.md").read_text() == make_flags().render(), "run: python docs/make_flags.py"


def test_flags_md_lists_every_flag_with_its_docstring():
    flags_md = (DOCS / "flags.md").read_text()
    fields = flag_fields(rloo_multinode.Args) + flag_fields(rloo_multinode.ServeArgs)
    missing = [f.name for f in fields if f"`--{f.name}`" not in flags_md]
    assert not missing, missing  # rloo.py's flags, rloo_multinode.py's engine flags and serve's
    documented = {flag.name for cls in (rloo_multinode.Args, rloo_multinode.ServeArgs)
                  for flags in make_flags().groups_of(cls).values() for flag in flags if flag.doc}
    undocumented = [f.name for f in fields if f.name not in documented]
    assert not undocumented, undocumented  # a flag without a docstring would be a row without a meaning


def test_make_flags_groups_by_the_args_comments():
    flags_md = (DOCS / "flags.md").read_text()
    headings = re.findall(r"^## (.+)$", flags_md, flags=re.M)
    assert headings[0] == "TRL's names"
    groups = [group for cls in (plumbing.flags.InputArgs, rloo.Args)  # the inputs' first, then the algorithm's
              for group in re.findall(r"# -{3,} (.+?) -{3,}", inspect.getsource(cls))]
    assert [h.lower() for h in headings[1:1 + len(groups)]] == [g.lower() for g in groups]
    assert len(headings) >= 4, headings
    multinode = [h for h in headings if h.endswith("(`rloo_multinode.py` only)")]
    assert multinode and "`rloo_multinode.py serve`" in headings, headings
    engines = flags_md[flags_md.index(f"## {multinode[0]}"):]  # rloo_multinode.py's own flags, then serve's
    assert "`--num_engines`" in engines and "`--rloo_k`" not in engines


def test_docs_explain_every_logged_metric_name():
    """docs/metrics.md explains every metric the code logs; a copy's own new metric is said in one line, its test
    skipped (RLOO_STOCK=1, the project's CI: failed)."""
    metrics_md = (DOCS / "metrics.md").read_text()
    source = "".join(path.read_text() for path in [REPO / "rloo.py", REPO / "rloo_multinode.py",
                                                     *sorted((REPO / "plumbing").glob("*.py"))])
    groups = "objective|policy|loss|val|completions|eval|rollout|mismatch|time|work|memory"
    logged = set(re.findall(rf'"((?:{groups})/[a-z_]+)"', source))
    assert len(logged) > 30, logged
    missing = [m for m in sorted(logged) if f"`{m}`" not in metrics_md and f"`{m.split('/')[1]}`" not in metrics_md]
    if missing:
        stock_text_differs(f"it logs metrics docs/metrics.md does not explain: {', '.join(missing)}")


def test_flags_md_maps_every_trl_name():
    flags_md = (DOCS / "flags.md").read_text()
    table = flags_md[flags_md.index("## TRL's names"):flags_md.index("\n## ", flags_md.index("## TRL's names") + 1)]
    for trl_name, own in plumbing.TRL_NAMES.items():
        assert f"| `--{own}` | `--{trl_name}` |" in table, trl_name
    assert "`--steps_per_generation`" in table


def test_readme_is_one_screen_per_question():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES, len(readme.splitlines())
    for heading in ("## Two commands", "## Your model, your data", "## The algorithm", "## Changing the algorithm",
                    "## The TL;DR recipe", "## Against TRL", "## Files"):
        assert f"\n{heading}" in readme, heading
    assert "row `j*B + i` is sample j of prompt i" in readme
    assert "--reward_fn package.module:function" in readme
    for doc in ("flags", "checkpoints-and-faults", "scaling-out", "speed-and-memory", "metrics", "tests"):
        assert f"(docs/{doc}.md" in readme, doc


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but `-` and `_` dropped, spaces as `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # a `# comment` in a code block is no heading
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def test_the_time_budgets_are_written_where_a_reader_looks_and_ci_prints_its_total():
    """`.ci/run` within 35 minutes and `make test` within 4 on 2 idle cores: said in the README, docs/tests.md and
    make help, never an older figure beside them; .ci/run prints each target's seconds and its total."""
    readme, tests_md = (REPO / "README.md").read_text(), (DOCS / "tests.md").read_text()
    makefile, ci = (REPO / "Makefile").read_text(), (REPO / ".ci" / "run").read_text()
    assert re.search(r"make test +# .*within 4 min on 2 idle cores", readme)
    assert "within 35 minutes on 2 idle cores" in readme
    assert "**`bash .ci/run` within 35 minutes**" in tests_md and "**`make\ntest` within 4 minutes**" in tests_md
    assert re.search(r"^test: .*## .*within 4 min on 2 idle cores", makefile, flags=re.M)
    assert not re.search(r"~13 min|about 13 minutes", readme + tests_md + makefile)
    assert "budget 35 min" in ci and "total $total s" in ci
    targets = re.findall(r"^target ([a-z-]+)", ci, flags=re.M)  # every target through the timer
    assert not re.search(r"^make ", ci, flags=re.M) and len(targets) == 10, targets


def test_every_relative_link_points_to_a_file_and_heading_that_exist():
    checked, broken = 0, []
    pages = [REPO / "README.md", *sorted(DOCS.glob("*.md")), *(REPO / "benchmark").glob("README.md"),
             *(REPO / "benchmark" / "tldr").glob("README.md")]
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            checked += 1
            if not file.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert checked > 20, checked
    assert not broken, broken


def test_slug_is_githubs():
    assert slug("Engines (`rloo_multinode.py` only)") == "engines-rloo_multinodepy-only"
    assert slug("TRL's names") == "trls-names"
    assert slug("What has run for real, and where") == "what-has-run-for-real-and-where"
    assert slug("Sampler/trainer mismatch") == "samplertrainer-mismatch"


SYMBOL = r"[A-Za-z]\w*'?"  # a shape's symbol: B, k, Tr, Tq', num_ppo_epochs


def shape_symbols(source: str) -> set[str]:
    """The symbols of every `# (..)` shape comment of a source (a bracket of prose, e.g. `# (a bf16 copy)`, is none:
    each of a shape's items is a product or sum of symbols and numbers, or `..`)."""
    symbols = set()
    for shape in re.findall(r"# \(([^()]*)\)", source):
        items = [re.sub(r"\s*([*+])\s*", r"\1", item.strip()) for item in shape.split(",")]
        if all(re.fullmatch(rf"(\.\.|{SYMBOL}|\d+)([*+]({SYMBOL}|\d+))*|", item) for item in items):
            symbols |= set(re.findall(SYMBOL, shape))
    return symbols


def test_the_shape_legend_names_every_symbol_of_rloo_pys_shape_comments():
    source = (REPO / "rloo.py").read_text()
    legend = source.split("\nShapes", 1)[1].split("\n\n", 1)[0]
    named = set(re.findall(SYMBOL, legend)) | {f.name for f in dataclasses.fields(rloo.Args)}  # a flag names itself
    symbols = shape_symbols(source)
    assert {"k", "B", "N", "Tr", "Tr'", "V", "L", "P", "n"} <= symbols  # the comments are read
    assert not symbols - named, f"in shape comments, not in rloo.py's shape legend: {sorted(symbols - named)}"
    assert shape_symbols("x = y  # (M, Tr) a (bf16 copy, an engine)") == {"M", "Tr"}  # and an unknown one is seen


def test_readmes_first_run_is_the_demos_starting_point_and_runs_as_written(tmp_path, monkeypatch):
    """"Your model, your data": the environment's python named, and the demo's settings (which `make demo` prints
    and trains with until its score rises): the same flags and values, but for the paths and the completion length.
    Its checks pass where the user's model and data are at the paths it names."""
    from benchmark import demo

    readme = (REPO / "README.md").read_text()
    block = re.search(r"```bash\n(\.venv/bin/python rloo\.py .*?)\n\.venv/bin/torchrun", readme, flags=re.S).group(1)
    words = block.replace("\\\n", " ").split()[2:]
    readme_flags = dict(zip(words[::2], words[1::2]))
    assert all(word.startswith("--") for word in words[::2]), words
    demo_words = demo.rloo_command(demo.Args(), {k: "x" for k in ("policy", "reward_model", "train", "test")})[2:]
    demo_flags = dict(zip(demo_words[::2], demo_words[1::2]))
    shared = {"--rloo_k", "--per_device_train_batch_size", "--num_ppo_epochs", "--learning_rate", "--kl_coef",
              "--temperature", "--missing_eos_penalty", "--total_episodes", "--logging_steps"}
    assert shared <= set(readme_flags), set(readme_flags)
    assert {f: float(readme_flags[f]) for f in shared} == {f: float(demo_flags[f]) for f in shared}
    monkeypatch.chdir(tmp_path)
    (tmp_path / readme_flags["--model_name_or_path"]).mkdir(parents=True)
    for flag in ("--dataset_name", "--dataset_test_split"):
        (tmp_path / readme_flags[flag]).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / readme_flags[flag]).write_text('{"prompt": "a"}\n')
    plumbing.validate_args(plumbing.parse_args(rloo.Args, argv=words, prog="rloo.py"))
    shutil.rmtree(tmp_path / "path")  # and where they are not, the first missing one is named
    with pytest.raises(plumbing.ConfigError, match="--model_name_or_path path/to/sft_model: no such file"):
        plumbing.validate_args(plumbing.parse_args(rloo.Args, argv=words, prog="rloo.py"))
