"""Every command under experiments/: `--help` answers with exit status 0, and a reader
that closes the pipe early ends the command quietly."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from experiments.cli_errors import CLOSED_PIPE_EXIT
from tests.cli_runner import REPO, run_module


def _entry_points(commands: bool = True) -> list[str]:
    """The modules under experiments/ that run as commands (`python -m ...`), or with
    `commands=False` the helpers that answer `python -m` with `not_a_command`."""
    modules = []
    for path in sorted((REPO / "experiments").rglob("*.py")):
        text = path.read_text()
        if ('if __name__ == "__main__":' in text
                and ("not_a_command(" not in text or path.name == "cli_errors.py") == commands):
            modules.append(".".join(path.relative_to(REPO).with_suffix("").parts))
    return modules


ENTRY_POINTS = _entry_points()
HELPERS = _entry_points(commands=False)


def test_the_commands_are_found():
    assert {"experiments.run", "experiments.compare", "experiments.sweep",
            "experiments.calibrate", "experiments.train_ranker",
            "experiments.reproduce.distserve",
            "experiments.reproduce.seed_examples",
            "experiments.reproduce.cached_attention",
            "experiments.reproduce.autellix"} <= set(ENTRY_POINTS)


REPRODUCTIONS = [m for m in ENTRY_POINTS if m.startswith("experiments.reproduce.")]


@pytest.mark.parametrize("module", REPRODUCTIONS)
def test_a_reproduction_refuses_a_bad_flag_in_one_line_with_exit_2(module):
    # Each reproduction parses its flags in its own way (its own FlagValues through the
    # shared helpers, or absl's global flags); none may answer with absl's usage text and
    # exit status 1. seed_examples has no --num_requests: an unknown flag is bad input too.
    flag = "--num_requests=abc"
    result = run_module(module, flag, check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "num_requests" in lines[0]
    if "Unknown" not in lines[0]:
        assert flag in lines[0]
    assert result.stdout == ""


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_help_exits_0_and_prints_the_flags(module):
    result = run_module(module, "--help", check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--" in result.stdout and "Traceback" not in result.stderr


def _with_stdout_closed(*args: str) -> subprocess.CompletedProcess:
    """`python -m ARGS` whose stdout's reader has gone before anything is written,
    as `| head -1` leaves a command that writes past the first line."""
    process = subprocess.Popen([sys.executable, "-m", *args], cwd=REPO,
                               env=dict(os.environ, JAX_PLATFORMS="cpu"),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    process.stdout.close()
    stderr = process.stderr.read()
    process.wait(timeout=300)
    return subprocess.CompletedProcess(args, process.returncode, "", stderr)


@pytest.mark.parametrize("args", [("experiments.run", "--describe_policy=vllm"),
                                  ("experiments.run", "--help"),
                                  ("experiments.reproduce.orca", "--help")])
def test_a_closed_pipe_ends_the_command_without_a_traceback(args):
    result = _with_stdout_closed(*args)
    assert result.returncode == CLOSED_PIPE_EXIT
    assert result.stderr == "", result.stderr[-2000:]


@pytest.mark.parametrize("module,listing", [
    ("experiments.run", "policies"), ("experiments.run", "routers"),
    ("experiments.run", "models"), ("experiments.run", "hardware"),
    ("experiments.compare", "policies"), ("experiments.sweep", "routers")])
def test_list_flags_print_the_registered_names_one_per_line(module, listing):
    import policies  # noqa: F401  (registers the built-ins)
    from orca_jax.cluster.routing import registered_routers
    from orca_jax.core.api.policy import registered_policies
    from orca_jax.specs.hardware import HARDWARE_ALIASES, HARDWARE_PRESETS
    from orca_jax.specs.model_config import PRESETS

    def builtin(registry):  # this process may have registered test plugins too
        return {name for name, cls in registry.items() if cls.__module__.startswith("policies")}

    expected = {"policies": builtin(registered_policies()),
                "routers": builtin(registered_routers()),
                "models": set(PRESETS),
                "hardware": set(HARDWARE_PRESETS) | set(HARDWARE_ALIASES)}[listing]
    result = run_module(module, f"--list_{listing}")
    lines = result.stdout.splitlines()
    assert len(lines) == len(set(lines)) and set(lines) == expected


def test_a_helper_run_as_a_command_says_which_command_to_run_in_one_line():
    assert {"experiments.reproduce.slo_scale", "experiments.reproduce.common"} <= set(HELPERS)
    for module in HELPERS:
        result = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO,
                                env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
                                text=True, timeout=60)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1, (module, result.stderr[-500:])
        assert lines[0].startswith(f"error: {module} is not a command: it holds ")
        assert "run python -m experiments.reproduce." in lines[0]


def test_train_ranker_help_is_quick_and_loads_neither_jax_nor_orbax():
    # Its --help took 37 s on a cold machine, importing jax, optax and orbax to train.
    result = subprocess.run([sys.executable, "-X", "importtime", "-m",
                             "experiments.train_ranker", "--help"], cwd=REPO,
                            env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 0 and "--num_steps" in result.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()
                if line.startswith("import time:")}
    assert "orca_jax.learned.ranker_config" in imported
    assert not {"jax", "optax", "orbax", "orbax.checkpoint"} & imported
