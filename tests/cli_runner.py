"""Running the entry points as a user does, for the command-line tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def run_module(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """`python -m ARGS...` in the repository root on the CPU; with `check`, a non-zero
    exit fails the test with the end of its stderr."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    if check and result.returncode != 0:
        raise AssertionError(result.stderr[-3000:])
    return result


def read_jsonl(path: os.PathLike) -> list[dict[str, Any]]:
    """The rows of a JSON-lines file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines()]
