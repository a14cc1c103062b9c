"""make mutate's own machinery (tests/mutation.py): which tests run a mutant's lines, found by its line tracer."""

import json
import os
import subprocess
import sys

import mutation
from helpers import REPO, stock_text_differs


def test_snippet_lines_are_the_lines_a_snippet_spans():
    text = "a\n    kl = kl * mask\nb\nc = 1\nd = 2\n"
    assert mutation.snippet_lines(text, "    kl = kl * mask\n") == range(2, 3)
    assert mutation.snippet_lines(text, "\nc = 1\nd") == range(4, 6)  # a leading newline belongs to the line before
    elsewhere = []  # a copy's change: snippets no longer there once
    for name, path, snippet, _ in mutation.MUTANTS:  # every mutant's first line is where its snippet starts
        source = (REPO / path).read_text()
        if source.count(snippet) != 1:
            elsewhere.append(name)
            continue
        first = source.splitlines()[mutation.snippet_lines(source, snippet)[0] - 1]
        assert snippet.strip("\n").splitlines()[0].strip() in first, name
    if elsewhere:
        stock_text_differs(f"the snippets of {len(elsewhere)} mutants are not in it once ({', '.join(elsewhere)})")


def test_the_tracer_finds_the_tests_that_run_a_line_and_a_line_run_at_import_selects_every_test(tmp_path):
    (tmp_path / "rloo.py").write_text("LIMIT = 3\n\n\ndef bump(x):\n    return x + 1\n\n\n"
                                      "def unused():\n    return 0\n")
    (tmp_path / "test_a.py").write_text("import rloo\n\n\ndef test_bumps():\n    assert rloo.bump(1) == 2\n")
    (tmp_path / "test_b.py").write_text("import rloo\n\n\ndef test_limit():\n    assert rloo.LIMIT == 3\n")
    out = tmp_path / "coverage.json"
    env = {**os.environ, mutation.COVERAGE_OUT: str(out), "PYTHONPATH": f"{REPO / 'tests'}{os.pathsep}{tmp_path}"}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "mutation", "-p", "no:cacheprovider",
                             "-p", "no:xdist", "test_a.py", "test_b.py"], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    coverage = json.loads(out.read_text())
    assert coverage["test_a.py::test_bumps"] == [["rloo.py", 5]]
    assert "test_b.py::test_limit" not in coverage  # it runs no line of rloo.py inside a function
    assert mutation.covering_tests(coverage, "rloo.py", range(5, 6)) == ["test_a.py::test_bumps"]
    assert mutation.covering_tests(coverage, "rloo.py", range(9, 10)) == []  # no test runs it: all run, then
    assert mutation.covering_tests(coverage, "rloo.py", range(1, 2)) is None  # run at import: every test
