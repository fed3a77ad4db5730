"""Live migration on the real engine in other processes: the command line's
load_balance run on two jax replicas, and two replicas on two forced CPU devices copying
pages between them (test_migration_engine.py has the setting and the runs in this
process)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_migration_engine import CONFIG, MODEL, _engine, _requests, _tokens

import policies
from orca_jax import Scheduler
from orca_jax.model.weights import init_params

REPO = Path(__file__).resolve().parent.parent
# Steps another real-engine module compiled are loaded (conftest.py).
pytestmark = pytest.mark.usefixtures("session_compile_cache")


@pytest.fixture(scope="module")
def unmigrated():
    """test_migration_engine's unmigrated tokens (its steps loaded from the session's
    compile cache when that file compiled them first)."""
    return _tokens(Scheduler(_requests(), policies.make_policy("vllm"),
                             _engine(init_params(MODEL, seed=5)), CONFIG).run())


@pytest.mark.slow
def test_the_command_line_runs_load_balance_on_two_jax_replicas(tmp_path):
    from cli_runner import run_module

    out = tmp_path / "run"
    run_module("experiments.run", "--engine=jax", "--model=tiny", "--dtype=float32",
               "--clock=wall", "--policy=vllm", "--prefix_caching=off",
               "--num_replicas=2", "--router=round_robin", "--rebalancer=load_balance",
               "--rebalancer_opts=gap=0.05", "--rebalance_interval_s=0.002",
               "--num_requests=10", "--rate=200", "--max_num_seqs=4", "--max_num_tokens=64",
               "--buckets=16,64", "--num_kv_pages=96", "--max_model_len=192", f"--out_dir={out}")
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    moves = [json.loads(line) for line in (out / "migrations.jsonl").read_text().splitlines()]
    assert json.loads((out / "status.json").read_text())["status"] == "finished"
    assert summary["num_finished"] == len(rows) == 10  # none lost on the way
    assert summary["rebalancer"] == "load_balance" and summary["num_migrations"] == len(moves)
    assert moves and all(m["from_replica"] != m["to_replica"] and m["downtime_s"] > 0
                         for m in moves)
    assert summary["migration_pages_total"] == sum(m["num_pages"] for m in moves)
    assert sorted({row["replica"] for row in rows}) == [0, 1]


# Two CPU devices forced in a fresh process: replica 0 on device 0, replica 1 on device 1.
SEPARATE_DEVICES = """
import json, sys
import jax
sys.path.insert(0, "tests")
import test_migration_engine as t
cluster = t._cluster(t.init_params(t.MODEL, seed=5), t.MoveAfter(after={0: 3, 1: 2, 4: 0}),
                     devices=jax.devices()[:2])
result = cluster.run()
print(json.dumps({"devices": [r.engine.device.id for r in cluster.replicas],
                  "migrated": sorted(m.request for m in cluster.migrator.log),
                  "tokens": t._tokens(result)}))
"""


@pytest.mark.slow
def test_replicas_on_separate_devices_copy_pages_between_them(unmigrated):
    result = subprocess.run(
        [sys.executable, "-c", SEPARATE_DEVICES], cwd=REPO, capture_output=True, text=True,
        env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO),
                 XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} "
                           "--xla_force_host_platform_device_count=2"), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["devices"] == [0, 1] and seen["migrated"] == [0, 1, 4]
    assert {int(k): v for k, v in seen["tokens"].items()} == unmigrated
