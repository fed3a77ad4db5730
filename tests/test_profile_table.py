"""The profiled clock's table across processes: a rerun with it repeats the run bit for bit,
whether it reads the table from the store (the default) or from a file."""

import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from orca_jax.core.step.packing import bucket_config_for
from orca_jax.runner.build import build_engine, profile_table_record, scheduler_config
from orca_jax.runner.spec import JaxEngineSpec, LimitsSpec, RunSpec, WorkloadSpec
from orca_jax.sim import profile_store

REPO = Path(__file__).resolve().parents[1]
# One small bucket, a few short requests: the run is mostly compiling and profiling.
RUN = ("--engine=jax", "--model=tiny", "--num_requests=5", "--max_num_tokens=16",
       "--max_num_seqs=4", "--prompt_len=uniform:4:12", "--output_len=uniform:2:6")


def _run(*args: str) -> str:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-m", "experiments.run", *RUN, *args], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    return result.stderr


def test_a_rerun_in_another_process_with_the_table_gives_identical_requests(tmp_path):
    first, second, third = tmp_path / "first", tmp_path / "second", tmp_path / "third"
    store = f"--profile_store={tmp_path / 'store'}"
    _run(f"--out_dir={first}", store)  # times the table, stores it, copies it beside the results
    table = first / "profile.json"
    digest = hashlib.sha256(table.read_bytes()).hexdigest()
    record = json.loads((first / "config.json").read_text())["profile_table"]
    [stored] = record.pop("stored")
    assert record == {"path": str(table), "sha256": digest, "loaded": False}
    assert not stored["reused"] and stored["file"] == str(tmp_path / "store" /
                                                         f"{stored['key']}.json")
    _run(f"--out_dir={second}", f"--profile_table={table}")  # reads it: no profiling
    assert json.loads((second / "config.json").read_text())["profile_table"] == {
        "path": str(table), "sha256": digest, "loaded": True, "stored": []}
    assert not (second / "profile.json").exists()
    # A later command on the same store reads the stored table and says so in one line.
    terminal = _run(f"--out_dir={third}", store)
    again = json.loads((third / "config.json").read_text())["profile_table"]
    assert again["loaded"] and again["sha256"] == digest
    assert again["stored"] == [{**stored, "reused": True}]
    when = f"{stored['measured_at'][:10]} {stored['measured_at'][11:16]}"
    assert re.search(rf"\] profiled clock: table {stored['key']} measured {when} on "
                     rf"{re.escape(stored['machine'])}, reused \(--profile_table=fresh to "
                     r"re-measure\)\n", terminal)
    assert "timing a grid" not in terminal
    requests = (first / "requests.jsonl").read_bytes()
    assert requests == (second / "requests.jsonl").read_bytes()
    assert requests == (third / "requests.jsonl").read_bytes()
    # The timings are the clock's, not constants: steps of different sizes cost differently.
    steps = [json.loads(line) for line in (first / "steps.jsonl").read_text().splitlines()]
    assert len({round(step["step_s"], 12) for step in steps}) > 1


@pytest.fixture
def store(tmp_path):
    """This process's table store in tmp_path, for the test; the setting restored after."""
    before = profile_store.current()
    yield profile_store.enable(str(tmp_path / "store"))
    profile_store.enable(str(before.folder) if before is not None else profile_store.DISABLED)


def _built(spec):
    config = scheduler_config(spec)
    limits = config.limits
    engine = build_engine(spec, config)
    engine.warmup(bucket_config_for(max_num_tokens=limits.max_num_tokens,
                                    max_num_seqs=limits.max_num_seqs,
                                    max_model_len=limits.max_model_len,
                                    page_size=config.kv.page_size,
                                    token_sizes=limits.token_buckets).buckets())
    return engine


@pytest.mark.usefixtures("session_compile_cache")  # the second engine loads the first's steps
def test_two_builds_of_one_spec_price_by_one_stored_table(store, tmp_path):
    spec = RunSpec(workload=WorkloadSpec(num_requests=2),
                   engine=JaxEngineSpec(model="tiny"),
                   limits=LimitsSpec(max_num_seqs=2, max_num_tokens=16, token_buckets=(8, 16)))
    first, second = _built(spec), _built(spec)
    assert first.num_timed_steps > 0 and second.num_timed_steps == 0 and second.table_loaded
    assert second.fit == first.fit and second.stored[0].key == first.stored[0].key
    record = profile_table_record(second, str(tmp_path / "run"))
    assert record["loaded"] and record["stored"][0]["reused"]
    # Another page geometry (or buckets) is another key: timed anew, both kept.
    paged = dataclasses.replace(spec, limits=dataclasses.replace(spec.limits, page_size=8))
    third = _built(paged)
    assert third.num_timed_steps > 0 and third.stored[0].key != first.stored[0].key
    # fresh times the first key again and replaces its table.
    fresh = _built(dataclasses.replace(spec, engine=JaxEngineSpec(model="tiny",
                                                                  profile_table="fresh")))
    assert fresh.num_timed_steps > 0 and fresh.stored[0].key == first.stored[0].key
    assert sorted(p.name for p in store.iterdir()) == sorted(
        f"{key}.json" for key in {first.stored[0].key, third.stored[0].key})
