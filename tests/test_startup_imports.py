"""What a simulator run's process imports: the modules only other runs use stay unloaded.

Every `python -m experiments.run` pays for what it imports (issue 34 prices whole
processes, and the command-line tests start hundreds of them), so the modules that
only a jax run, a cluster, a sweep or another workload kind uses are imported where
those runs need them. One process runs the command (`runpy`, as `-m` does) and then
reports which of them it loaded.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

import pytest

from experiments.process_exit import imports_uncollected
from tests.cli_runner import REPO

# Each with the runs that import it.
OTHER_RUNS_ONLY = (
    "jax",  # a real engine
    "orca_jax.sim.profiled_clock",  # a real engine's profiled clock (and its step profiler)
    "orca_jax.sim.profile_store",  # and its tables kept across processes
    "orca_jax.cluster.transfers",  # a cluster's KV handoffs and migrations
    "orca_jax.workloads.prefix_workloads",  # --workload=shared_prefix, conversation
    "orca_jax.workloads.program_traces",  # --workload=program_trace
    "orca_jax.results.sweep_store",  # a sweep
    "orca_jax.runner.sweep_point",
)

CHILD = """
import gc, json, runpy, sys
sys.argv = ["experiments.run", "--engine=sim", "--policy=vllm", "--model=llama3-8b",
            "--hardware=a100", "--num_requests=3", "--out_dir=" + sys.argv[1]]
try:
    runpy.run_module("experiments.run", run_name="__main__", alter_sys=True)
except SystemExit as exit:
    assert not exit.code, exit.code
print(json.dumps({"loaded": [name for name in NAMES if name in sys.modules],
                  "gc_enabled": gc.isenabled()}))
"""


def test_a_sim_run_leaves_other_runs_modules_unloaded(tmp_path):
    code = f"NAMES = {OTHER_RUNS_ONLY!r}\n" + CHILD
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")], cwd=REPO,
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["loaded"] == []
    # The imports ran without collections (`imports_uncollected`); collection is on again.
    assert report["gc_enabled"]
    assert (tmp_path / "run" / "summary.json").is_file()


@pytest.mark.parametrize("enabled", [True, False])
def test_imports_uncollected_restores_the_collector_as_it_was(enabled):
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        with pytest.raises(ImportError):
            with imports_uncollected():
                assert not gc.isenabled()
                import orca_jax_no_such_module  # noqa: F401  (an import that fails)
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
