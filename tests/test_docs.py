"""The README documents every flag and every metric rloo.py logs."""

import dataclasses
import re

import rloo
from conftest import REPO


def test_readme_lists_every_flag():
    readme = (REPO / "README.md").read_text()
    missing = [f.name for f in dataclasses.fields(rloo.Args) if f"`--{f.name}`" not in readme]
    assert not missing, missing


def test_readme_explains_every_logged_metric_name():
    readme = (REPO / "README.md").read_text()
    source = (REPO / "rloo.py").read_text()
    logged = set(re.findall(r'"((?:objective|policy|loss|val|completions|eval)/[a-z_]+)"', source))
    missing = [m for m in sorted(logged) if f"`{m}`" not in readme and f"`{m.split('/')[1]}`" not in readme]
    assert not missing, missing
