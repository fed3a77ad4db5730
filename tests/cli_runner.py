"""Running the entry points as a user does, for the command-line tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Mapping, Optional

REPO = Path(__file__).resolve().parents[1]


def run_module(*args: str, check: bool = True,
               env: Optional[Mapping[str, Optional[str]]] = None) -> subprocess.CompletedProcess:
    """`python -m ARGS...` in the repository root on the CPU; with `check`, a non-zero
    exit fails the test with the end of its stderr. `env` sets variables (None: unsets)."""
    environment = dict(os.environ, JAX_PLATFORMS="cpu")
    for name, value in (env or {}).items():
        if value is None:
            environment.pop(name, None)
        else:
            environment[name] = value
    result = subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=environment,
                            capture_output=True, text=True, timeout=300)
    if check and result.returncode != 0:
        raise AssertionError(result.stderr[-3000:])
    return result


def run_sweep(out_dir: os.PathLike, *args: str, exit_after: int = 0,
              env: Optional[Mapping[str, Optional[str]]] = None) -> subprocess.CompletedProcess:
    """`python -m experiments.sweep ARGS... --out_dir=OUT_DIR`, unchecked (its exit code is
    the test's to read); with `exit_after`, the process dies after that many points, as a
    kill would (the sweep's test-only hook)."""
    from orca_jax.runner.sweep import EXIT_AFTER_ENV

    return run_module("experiments.sweep", *args, f"--out_dir={out_dir}", check=False,
                      env={**(env or {}), EXIT_AFTER_ENV: str(exit_after) if exit_after else None})


def read_jsonl(path: os.PathLike) -> list[dict[str, Any]]:
    """The rows of a JSON-lines file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines()]
