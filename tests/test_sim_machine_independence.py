"""The simulator's results are the same bits whatever the CPU's kernels: one frozen case of
tests/test_sim_results_frozen.py, run under two OpenBLAS kernels and without numpy's SIMD
dispatch, writes the same results each time, and they are the frozen ones.

A cost model that priced a step with `np.dot` got the last bits of `step_s` from whichever
BLAS kernel the CPU picked (AVX-512 and AVX2 add in different orders), so a reviewer on
another machine reran an artifact into other numbers (issue 25). `OPENBLAS_CORETYPE`
picks the kernel here: Haswell (AVX2) and Prescott (SSE3) run on any x86-64 CPU with AVX2,
AMD or Intel. `NPY_DISABLE_CPU_FEATURES` turns numpy's dispatched SIMD loops off, so its
reductions and elementwise loops take the baseline path.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from results_digest import results_digest
from test_sim_results_frozen import CASES, COMMON, DIGESTS

REPO = Path(__file__).resolve().parents[1]
CASE = "vllm"


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def _numpy_dispatch() -> list[str]:
    """The SIMD targets numpy dispatches to at run time (turned off: the baseline loops)."""
    core = getattr(np, "_core", None) or np.core
    return list(core._multiarray_umath.__cpu_dispatch__)


pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or platform.machine() != "x86_64" or "avx2" not in _cpu_flags(),
    reason="OPENBLAS_CORETYPE=Haswell needs an x86-64 Linux CPU with AVX2")

VARIANTS = {
    "openblas_haswell": {"OPENBLAS_CORETYPE": "Haswell"},
    "openblas_prescott": {"OPENBLAS_CORETYPE": "Prescott"},
    "openblas_prescott_numpy_baseline": {"OPENBLAS_CORETYPE": "Prescott",
                                         "NPY_DISABLE_CPU_FEATURES": ",".join(_numpy_dispatch())},
}


def _run(out: Path, env: dict[str, str]) -> Path:
    done = subprocess.run(
        [sys.executable, "-m", "experiments.run", *COMMON, *CASES[CASE], f"--out_dir={out}"],
        cwd=REPO, capture_output=True, text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu", **env}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_the_same_results_under_every_blas_kernel_and_simd_dispatch(tmp_path):
    outs = {name: _run(tmp_path / name, env) for name, env in VARIANTS.items()}
    digests = {name: results_digest(out) for name, out in outs.items()}
    assert set(digests.values()) == {DIGESTS[CASE]}, digests
    # Every request's row, byte for byte (steps.jsonl and summary.json differ only in the
    # measured host time, which the digests leave out).
    first, *others = (out / "requests.jsonl" for out in outs.values())
    assert all(other.read_bytes() == first.read_bytes() for other in others)
