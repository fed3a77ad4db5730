"""examples/slo_admission.py: rejecting what cannot meet the TTFT SLO keeps the rest on time.

On a simulated overload, plain FCFS (vllm) and Orca serve everyone and most of
them late; the example rejects, with its reason, the requests whose SLO is out
of reach, and nearly every request it admits meets the SLO.
"""

import json
from pathlib import Path

import pytest

from orca_jax import RequestState, make_policy
from orca_jax.runner.experiment import run_policy
from orca_jax.runner.spec import LimitsSpec, RunSpec, SimEngineSpec, WorkloadSpec

EXAMPLE = f"{Path(__file__).resolve().parents[1] / 'examples' / 'slo_admission.py'}:SLOAdmission"
SLO_S = 1.0


def overload(**run) -> RunSpec:
    """About twice what the pool and budget serve within the SLO: 40 requests/s."""
    return RunSpec(
        workload=WorkloadSpec(arrival="poisson", rate=40.0, num_requests=150,
                              prompt_len="uniform:64:512", output_len="uniform:8:64"),
        engine=SimEngineSpec(step_time_ms=20),
        limits=LimitsSpec(max_num_seqs=16, max_num_tokens=512, num_kv_pages=256, page_size=16,
                          max_model_len=1024), **run)


def late_among_admitted(result) -> tuple[int, int]:
    """(finished requests whose TTFT missed the SLO, finished requests)."""
    finished = result.state == RequestState.FINISHED
    ttft = (result.first_token_s - result.arrival_s)[finished]
    return int((ttft > SLO_S).sum()), int(finished.sum())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("slo")
    return {name: run_policy(overload(ttft_slo_s=SLO_S), spec, out_dir=out / name,
                             progress=False) + (out / name,)
            for name, spec in [("slo_admission", EXAMPLE), ("vllm", "vllm"), ("orca", "orca")]}


def test_admitted_requests_meet_the_slo_where_fcfs_misses_it(runs):
    late, finished = late_among_admitted(runs["slo_admission"][1])
    assert finished >= 40 and late <= 0.05 * finished
    for baseline in ("vllm", "orca"):
        base_late, base_finished = late_among_admitted(runs[baseline][1])
        assert base_finished == 150  # they admit everyone ...
        assert base_late >= 0.5 * base_finished  # ... and serve most of them late
    assert runs["slo_admission"][0]["goodput_req_s"] > 2 * runs["vllm"][0]["goodput_req_s"]


def test_rejected_requests_carry_the_policys_reason(runs):
    summary, result, out = runs["slo_admission"]
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    rejected = [row for row in rows if row["status"] == "rejected"]
    assert len(rejected) == summary["num_rejected"] == int(
        (result.state == RequestState.REJECTED).sum()) > 0
    for row in rejected:
        assert row["reason"].startswith("policy slo_admission: TTFT SLO 1 s unreachable: waited ")
        assert row["first_token_s"] is None and row["num_generated"] == 0  # never served


def test_without_an_slo_it_serves_everyone():
    summary, result = run_policy(overload(), EXAMPLE, progress=False)
    assert summary["num_rejected"] == 0
    assert (result.state == RequestState.FINISHED).all()


def test_it_loads_by_path_with_its_knob():
    policy = make_policy(EXAMPLE, {"slack": "1.5"})
    assert policy.name == "slo_admission" and policy.slack == 1.5
