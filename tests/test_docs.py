"""The README documents every flag and every metric of rloo.py and rloo_multinode.py."""

import dataclasses
import re

import plumbing
import rloo_multinode
from conftest import REPO


def test_readme_lists_every_flag():
    readme = (REPO / "README.md").read_text()
    missing = [f.name for f in dataclasses.fields(rloo_multinode.Args) if f"`--{f.name}`" not in readme]
    assert not missing, missing  # rloo.py's flags and rloo_multinode.py's engine flags


def test_readme_explains_every_logged_metric_name():
    readme = (REPO / "README.md").read_text()
    source = (REPO / "rloo.py").read_text() + (REPO / "rloo_multinode.py").read_text()
    logged = set(re.findall(r'"((?:objective|policy|loss|val|completions|eval|rollout|mismatch)/[a-z_]+)"', source))
    logged |= set(re.findall(r'"(time/[a-z_]+)"', (REPO / "rloo_multinode.py").read_text()))
    missing = [m for m in sorted(logged) if f"`{m}`" not in readme and f"`{m.split('/')[1]}`" not in readme]
    assert not missing, missing


def test_readme_maps_every_trl_name():
    readme = (REPO / "README.md").read_text()
    table = readme[readme.index("### TRL's names"):]
    for trl_name, own in plumbing.TRL_NAMES.items():
        assert f"| `--{own}` | `--{trl_name}` |" in table, trl_name
    assert "`--steps_per_generation`" in table
