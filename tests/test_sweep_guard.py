"""A sweep cannot be poisoned (a typo writes nothing) or raced (one sweep per folder)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orca_jax.core.api.policy import PolicyLoadError
from orca_jax.results.sweep_store import LOCK_FILE, SweepLockedError
from orca_jax.runner import sweep
from orca_jax.runner.spec import LimitsSpec, RunSpec, SimEngineSpec, WorkloadSpec

REPO = Path(__file__).resolve().parents[1]
SPEC = RunSpec(workload=WorkloadSpec(num_requests=12, prompt_len="uniform:8:64",
                                     output_len="uniform:1:24"),
               engine=SimEngineSpec(model="tiny", step_time_ms=5.0),
               limits=LimitsSpec(max_num_seqs=4))


def test_a_typo_in_a_knob_leaves_no_sweep_json_and_the_corrected_rerun_runs(tmp_path):
    out = tmp_path / "sweep"
    typo = [sweep.PolicyRun("orca", "orca"), sweep.PolicyRun("vllm", "vllm",
                                                              {"max_num_seqz": "2"})]
    with pytest.raises(PolicyLoadError, match="max_num_seqz"):
        sweep.run_sweep(SPEC, typo, [2.0], [0], str(out))
    assert not (out / "sweep.json").exists() and not (out / "points.jsonl").exists()
    fixed = [typo[0], sweep.PolicyRun("vllm", "vllm", {"max_num_seqs": "2"})]
    store, keys = sweep.run_sweep(SPEC, fixed, [2.0], [0], str(out))
    assert sorted(p["policy"] for p in store.load()) == ["orca", "vllm"]
    stored = json.loads((out / "sweep.json").read_text())
    assert stored["policies"]["vllm"]["options"] == {"max_num_seqs": "2"}
    assert (out / LOCK_FILE).read_bytes() == b""  # released: it names no holder


def test_a_second_sweep_into_a_folder_in_use_is_refused_naming_the_holder(tmp_path):
    out = tmp_path / "sweep"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop(sweep.EXIT_AFTER_ENV, None)
    command = [sys.executable, "-m", "experiments.sweep", "--engine=sim", "--model=tiny",
               "--step_time_ms=5", "--policies=vllm", "--rates=4", "--seeds=0",
               f"--out_dir={out}"]
    # Long enough to be running while the second one starts.
    first = subprocess.Popen([*command, "--num_requests=300000"], cwd=REPO, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        holder = {}
        while first.poll() is None and not holder:  # however long it takes to get there
            lock = out / LOCK_FILE
            holder = json.loads(lock.read_bytes() or b"{}") if lock.exists() else {}
            time.sleep(0.1)
        assert holder.get("pid") == first.pid, "the first sweep never took the lock"
        with pytest.raises(SweepLockedError, match=f"in use by another sweep \\(pid {first.pid} "
                                                   "on .*, started "):
            sweep.run_sweep(SPEC, [sweep.PolicyRun("vllm", "vllm")], [4.0], [0], str(out))
        second = subprocess.run([*command, "--num_requests=12"], cwd=REPO, env=env,
                                capture_output=True, text=True, timeout=120)
        assert first.poll() is None, "the first sweep ended too soon for the test"
    finally:
        first.kill()
        first.wait()
    assert second.returncode == 2  # a folder in use is bad usage, as for runs
    [line] = second.stderr.strip().splitlines()
    assert line.startswith(f"error: {out} is in use by another sweep (pid {first.pid} on ")
    assert not (out / "points.jsonl").exists()  # the second one ran nothing


def test_a_lock_whose_holder_is_gone_is_taken_over_with_a_line(tmp_path, capsys):
    out = tmp_path / "sweep"
    out.mkdir()
    (out / LOCK_FILE).write_text(json.dumps({"pid": 2**22 + 12345, "host": "elsewhere",
                                             "started_at": 0.0}))
    store, _ = sweep.run_sweep(SPEC, [sweep.PolicyRun("orca", "orca")], [2.0], [0], str(out))
    assert len(store.load()) == 1
    assert f"sweep: taking over the lock of pid {2**22 + 12345} on elsewhere" in (
        capsys.readouterr().err)


@pytest.mark.parametrize("trace, says", [
    ("/nonexistent.csv", "error: /nonexistent.csv: no such trace file"),
    ("bad.csv", "error: {trace}:3: field 'prompt_len': expected an integer >= 1, got 'abc'"),
])
def test_a_trace_that_does_not_load_is_exit_2_and_writes_nothing(tmp_path, trace, says):
    if trace == "bad.csv":
        trace = tmp_path / "bad.csv"
        trace.write_text("arrival_s,prompt_len,output_len\n0,10,5\n0.1,abc,5\n")
    out = tmp_path / "sweep"
    result = subprocess.run(
        [sys.executable, "-m", "experiments.sweep", "--engine=sim", "--policies=orca",
         "--rates=2", "--workload=trace", f"--trace={trace}", f"--out_dir={out}"],
        cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
        timeout=600)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [says.format(trace=trace)]
    assert not out.exists()  # no sweep.json, points.jsonl, sweep.png or sweep.lock
