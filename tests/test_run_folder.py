"""A run's results folder never describes two runs, and a failed run says so.

Through the public entry points: `run_policy(..., out_dir=...)` and
`python -m experiments.run`; the folder's rules are in
`orca_jax/results/run_folder.py`.
"""

import dataclasses
import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments import flags as run_flags
from orca_jax.results import run_folder
from orca_jax.results.run_folder import (
    OutDirError,
    ResultsWriteError,
    check_out_dir,
    check_writable_dir,
    read_status,
)
from orca_jax.results.summary import request_rows, step_rows
from orca_jax.runner import live_results
from orca_jax.runner.build import build_workload
from orca_jax.runner.experiment import run_policy
from orca_jax.runner.spec import (
    ClusterSpec,
    LimitsSpec,
    RunSpec,
    SimEngineSpec,
    WorkloadSpec,
)

REPO = Path(__file__).resolve().parent.parent
RAISES = str(REPO / "tests/plugins/raising_policy.py") + ":RaisesAtStep"
SPEC = RunSpec(workload=WorkloadSpec(arrival="poisson", num_requests=60, rate=50.0,
                                     prompt_len="uniform:16:64", output_len="uniform:4:32"),
               engine=SimEngineSpec(step_time_ms=10.0),
               limits=LimitsSpec(max_num_seqs=8, max_num_tokens=256, num_kv_pages=512))


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _leftovers(root: Path) -> list[str]:
    """Staging folders, set-aside old folders and temporary files anywhere under root."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if ".running-" in p.name or ".old-" in p.name or p.name.endswith(".tmp"))


@pytest.fixture
def orca_run(tmp_path):
    """A folder holding a finished `orca` run's results."""
    out = tmp_path / "run"
    summary, _ = run_policy(SPEC, "orca", out_dir=str(out), progress=False)
    assert summary["num_finished"] == 60
    return out


def test_a_finished_run_streams_its_logs_and_ends_with_every_row_in_order(tmp_path):
    orca_run = tmp_path / "run"
    _, result = run_policy(SPEC, "orca", out_dir=str(orca_run), progress=False)
    status = read_status(orca_run)
    assert status["status"] == "finished" and status["label"] == "orca"
    summary = json.loads((orca_run / "summary.json").read_text())
    assert status["num_steps"] == summary["num_steps"] > 0
    assert status["virtual_time_s"] == summary["virtual_end_s"]
    # The streamed steps are the file; the requests are rewritten in arrival order.
    assert _lines(orca_run / "steps.jsonl") == step_rows(result)
    assert _lines(orca_run / "requests.jsonl") == request_rows(result)
    assert [row["id"] for row in _lines(orca_run / "requests.jsonl")] == list(
        result.request_ids)
    assert sorted(p.name for p in orca_run.iterdir()) == [
        "config.json", "requests.jsonl", "status.json", "steps.jsonl", "summary.json"]
    assert _leftovers(tmp_path) == []


def test_several_tenants_get_a_flat_summary_and_a_tenants_table(tmp_path):
    requests = [dataclasses.replace(r, tenant="ab"[r.id % 3 == 0])
                for r in build_workload(SPEC)]
    summary, _ = run_policy(SPEC, "orca", out_dir=str(tmp_path / "run"), requests=requests,
                            progress=False)
    stored = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert stored == summary and stored["num_tenants"] == 2
    assert all(not isinstance(v, (dict, list)) for v in stored.values())
    tenants = _lines(tmp_path / "run" / "tenants.jsonl")
    assert [t["tenant"] for t in tenants] == ["a", "b"]
    assert [t["num_requests"] for t in tenants] == [40, 20]
    assert sum(t["num_finished"] for t in tenants) == stored["num_finished"] == 60


def test_a_plugin_that_raises_leaves_its_partial_logs_marked_failed(orca_run, tmp_path):
    with pytest.raises(RuntimeError, match="planted failure at step 7"):
        run_policy(SPEC, RAISES, {"fail_at_step": "7"}, out_dir=str(orca_run), progress=False)
    status = read_status(orca_run)
    assert status["status"] == "failed" and status["reason"] == "error"
    assert status["error"] == "RuntimeError: planted failure at step 7"
    assert status["error_at"].endswith("raising_policy.py:21")
    assert status["step"] == 7 and status["virtual_time_s"] == pytest.approx(0.07, abs=0.06)
    # The earlier run's summary is gone: nothing in the folder looks like a finished run.
    assert not (orca_run / "summary.json").exists()
    assert json.loads((orca_run / "config.json").read_text())["policy"]["spec"] == RAISES
    steps = _lines(orca_run / "steps.jsonl")
    assert [s["step"] for s in steps] == list(range(7))
    rows = _lines(orca_run / "requests.jsonl")
    assert len(rows) == 60 and {r["status"] for r in rows} <= {"finished", "unfinished"}
    assert any(r["status"] == "unfinished" for r in rows)
    assert _leftovers(tmp_path) == []


def test_a_cluster_run_that_raises_is_marked_failed_too(orca_run, tmp_path):
    spec = dataclasses.replace(SPEC, cluster=ClusterSpec(num_replicas=2))
    with pytest.raises(RuntimeError, match="planted failure at step 4"):
        run_policy(spec, RAISES, {"fail_at_step": "4"}, out_dir=str(orca_run), progress=False)
    status = read_status(orca_run)
    assert (status["status"], status["step"]) == ("failed", 4)
    assert sorted(p.name for p in orca_run.iterdir()) == ["config.json", "status.json"]
    assert _leftovers(tmp_path) == []


def test_ctrl_c_marks_the_run_failed_as_interrupted(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        run_policy(SPEC, RAISES, {"fail_at_step": "3", "interrupt": "true"}, out_dir=str(out),
                   progress=False)
    status = read_status(out)
    assert (status["status"], status["reason"], status["step"]) == ("failed", "interrupted", 3)
    assert [s["step"] for s in _lines(out / "steps.jsonl")] == [0, 1, 2]
    assert _leftovers(tmp_path) == []


def test_a_bad_knob_fails_before_the_folder_changes(orca_run, tmp_path):
    before = {p.name: p.read_bytes() for p in orca_run.iterdir()}
    with pytest.raises(Exception, match="nope"):
        run_policy(SPEC, "orca", {"nope": "1"}, out_dir=str(orca_run), progress=False)
    assert {p.name: p.read_bytes() for p in orca_run.iterdir()} == before
    assert _leftovers(tmp_path) == []


def test_disk_full_is_one_line_and_leaves_the_old_run_and_no_tmp(orca_run, tmp_path,
                                                                 monkeypatch, capsys):
    real = run_folder.write_lines_atomic  # requests.jsonl's writer, at the run's end

    def fills_the_disk(path, lines):
        def lines_until_full():
            for k, line in enumerate(lines):
                if k == 10:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
                yield line
        real(path, lines_until_full())

    monkeypatch.setattr(run_folder, "write_lines_atomic", fills_the_disk)
    before = {p.name: p.read_bytes() for p in orca_run.iterdir()}
    with pytest.raises(ResultsWriteError) as caught:
        run_policy(SPEC, "vllm", out_dir=str(orca_run), progress=False)
    message = str(caught.value)
    assert "\n" not in message and "disk full" in message and str(orca_run) in message
    assert {p.name: p.read_bytes() for p in orca_run.iterdir()} == before
    assert _leftovers(tmp_path) == []
    with pytest.raises(SystemExit) as exited, run_flags.clean_errors():
        raise caught.value
    assert exited.value.code == 1  # a failed run, not bad usage
    assert capsys.readouterr().err == f"error: {message}\n"


def test_disk_full_while_streaming_stops_the_run_with_one_line(orca_run, tmp_path,
                                                               monkeypatch):
    real = run_folder.RunFolder._append_lines  # every streamed write
    calls = []

    def fills_the_disk(self, name, lines):
        calls.append(name)
        if len(calls) == 5:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(self, name, lines)

    monkeypatch.setattr(run_folder.RunFolder, "_append_lines", fills_the_disk)
    monkeypatch.setattr(live_results, "STREAM_BATCH", 1)  # rows out as they come: mid-run
    monkeypatch.setattr(live_results, "STREAM_EVERY_STEPS", 32)  # several writes in 60 requests
    before = {p.name: p.read_bytes() for p in orca_run.iterdir()}
    with pytest.raises(ResultsWriteError, match="disk full"):
        run_policy(SPEC, "vllm", out_dir=str(orca_run), progress=False)
    assert len(calls) == 5  # the run stopped at the failed write
    assert {p.name: p.read_bytes() for p in orca_run.iterdir()} == before
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("make, expected", [
    (lambda p: p.write_text("x"), "is a file, not a folder"),
    (lambda p: (p.mkdir(), (p / "notes.txt").write_text("mine")), "holds notes.txt, not a run"),
    (lambda p: (p.mkdir(), (p / "sub").mkdir()), "holds sub, not a run"),
])
def test_an_out_dir_that_cannot_hold_the_results_is_refused_before_the_run(
        tmp_path, make, expected, monkeypatch):
    out = tmp_path / "out"
    make(out)
    built = []
    monkeypatch.setattr("orca_jax.runner.experiment.build_workload",
                        lambda spec: built.append(spec) or build_workload(spec))
    with pytest.raises(OutDirError, match=expected):
        run_policy(RunSpec(workload=WorkloadSpec(num_requests=10**6)), "orca",
                   out_dir=str(out), progress=False)
    assert built == []  # the check came first: no workload was built
    assert _leftovers(tmp_path) == []


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
@pytest.mark.parametrize("check", [check_out_dir, check_writable_dir])
def test_a_folder_no_file_can_be_made_in_is_refused_though_access_says_yes(check):
    # /proc passes os.access for root; only a write shows that nothing can be created.
    with pytest.raises(OutDirError, match="^--out_dir /proc/orca_out: cannot create files in "
                                          "/proc: "):
        check("/proc/orca_out")
    assert not any(name.startswith(".orca_jax-probe") for name in os.listdir("/proc"))


@pytest.mark.parametrize("command", [
    ["experiments.run", "--policy=orca"],
    ["experiments.compare", "--policies=orca,vllm"],
    ["experiments.sweep", "--policies=orca", "--rates=4"],
])
def test_a_file_as_out_dir_is_one_line_and_exit_2_before_anything_runs(tmp_path, command):
    out = tmp_path / "a_file"
    out.write_text("not a folder")
    result = subprocess.run(
        [sys.executable, "-m", *command, "--engine=sim", "--num_requests=1000000",
         f"--out_dir={out}"],
        cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
        timeout=600)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        f"error: --out_dir {out}: is a file, not a folder"]
    assert out.read_text() == "not a folder"
    assert "workload:" not in result.stdout  # refused before the 10^6 requests were built


def test_a_sigkill_mid_run_leaves_the_old_folder_and_a_readable_staging_folder(orca_run,
                                                                               tmp_path):
    old = {p.name: p.read_bytes() for p in orca_run.iterdir()}
    process = subprocess.Popen(
        [sys.executable, "-m", "experiments.run", "--engine=sim", "--policy=vllm",
         "--num_requests=200000", "--rate=40", f"--out_dir={orca_run}"],
        cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    try:
        staged = []
        while process.poll() is None:  # however long it takes the run to get there
            staged = list(tmp_path.glob("run.running-*"))
            if staged and (staged[0] / "steps.jsonl").exists() and len(
                    (staged[0] / "steps.jsonl").read_bytes().splitlines()) > 100:
                break
            time.sleep(0.2)
        assert process.poll() is None, "the run ended before it could be killed"
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.kill()
        process.wait()
    assert {p.name: p.read_bytes() for p in orca_run.iterdir()} == old  # untouched
    [staging] = staged
    status = read_status(staging)
    assert status["status"] == "running" and status["pid"] == process.pid
    assert json.loads((staging / "config.json").read_text())["policy"]["name"] == "vllm"
    lines = (staging / "steps.jsonl").read_text().split("\n")
    # Every complete line is a step, in order; only a last line cut by the kill may not be.
    steps = [json.loads(line) for line in lines[:-1]]
    assert [s["step"] for s in steps] == list(range(len(steps))) and len(steps) > 100
    for line in (staging / "requests.jsonl").read_text().split("\n")[:-1]:
        assert json.loads(line)["status"] == "finished"
    # The next run into the folder that finishes removes what the killed one left.
    run_policy(SPEC, "orca", out_dir=str(orca_run), progress=False)
    assert not staging.exists() and _leftovers(tmp_path) == []
    assert read_status(orca_run)["status"] == "finished"


def _wait_for_lock_holder(process: subprocess.Popen, lock: Path) -> dict:
    """The holder `lock` names once `process` has taken it (however long that takes)."""
    holder: dict = {}
    while process.poll() is None and holder.get("pid") != process.pid:
        holder = json.loads(lock.read_bytes() or b"{}") if lock.exists() else {}
        time.sleep(0.1)
    return holder


@pytest.mark.parametrize("second", [
    ["experiments.run", "--num_requests=20"],
    ["experiments.compare", "--policies=orca", "--num_requests=20"],
])
def test_a_second_run_into_a_folder_in_use_is_refused_in_one_line(orca_run, tmp_path, second):
    old = {p.name: p.read_bytes() for p in orca_run.iterdir()}
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    first = subprocess.Popen(
        [sys.executable, "-m", "experiments.run", "--engine=sim", "--num_requests=300000",
         f"--out_dir={orca_run}"], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    try:
        holder = _wait_for_lock_holder(first, tmp_path / "run.lock")
        assert holder.get("pid") == first.pid, "the first run never took the lock"
        result = subprocess.run([sys.executable, "-m", *second, "--engine=sim",
                                 f"--out_dir={orca_run}"], cwd=REPO, env=env,
                                capture_output=True, text=True, timeout=600)
        assert first.poll() is None, "the first run ended too soon for the test"
    finally:
        first.kill()
        first.wait()
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: {orca_run} is in use by another run (pid {first.pid} on {holder['host']}, "
        f"started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(holder['started_at']))}"
        "); wait for it to end, or choose another --out_dir"]
    assert {p.name: p.read_bytes() for p in orca_run.iterdir()} == old  # the first's, as it was


def _lock_as_another_process(out: Path) -> None:
    """Takes and lets go `out`'s run lock as another process would: not re-entrant with
    the locks this process holds."""
    from orca_jax.results.folder_lock import FolderLock, run_lock

    held = dict(FolderLock._held)
    FolderLock._held.clear()
    try:
        with run_lock(out):
            pass
    finally:
        FolderLock._held.update(held)


def test_the_lock_is_reentrant_in_a_process_and_gone_once_the_run_ends(tmp_path):
    from orca_jax.results.folder_lock import FolderLockedError, run_lock

    out = tmp_path / "deep" / "run"
    with run_lock(out):  # as experiments.run holds it around run_policy
        run_policy(SPEC, "orca", out_dir=str(out), progress=False)  # takes it again
        assert (tmp_path / "deep" / "run.lock").exists()
        with pytest.raises(FolderLockedError, match=f"^{out} is in use by another run "):
            _lock_as_another_process(out)
    assert sorted(p.name for p in (tmp_path / "deep").iterdir()) == ["run"]
    _lock_as_another_process(out)  # free again
    with pytest.raises(FolderLockedError):
        with run_lock(tmp_path / "new" / "run"):
            _lock_as_another_process(tmp_path / "new" / "run")
    assert not (tmp_path / "new").exists()  # the folder the lock made, left empty, is gone


def test_compare_with_a_bad_trace_leaves_no_folder(tmp_path):
    trace = tmp_path / "bad.csv"
    trace.write_text("arrival_s,prompt_len,output_len\n0,10,5\n0.1,abc,5\n")
    out = tmp_path / "new" / "compare"
    result = subprocess.run(
        [sys.executable, "-m", "experiments.compare", "--engine=sim", "--policies=orca,vllm",
         "--workload=trace", f"--trace={trace}", f"--out_dir={out}"],
        cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
        timeout=600)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: {trace}:3: field 'prompt_len': expected an integer >= 1, got 'abc'"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.csv"]  # no folder, no lock
