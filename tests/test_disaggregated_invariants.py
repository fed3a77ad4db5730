"""Every built-in policy and both example plugins, in KV-tight disaggregated pools: nothing
stuck, nothing lost, every preemption logged.

The soak that found decode pools deadlocking (issue 25): a paused running request needs a
page while waiting requests that hold their transferred KV fill the pool, and the policy
stops admitting at a waiting request that needs pages. Each case here runs a random small
workload through a prefill and a decode pool with a few pages and a small batch cap, and
checks that the run ends, that every request finished with exactly its output (or was
rejected up front, with a reason), that every page went back to its pool, and that the
preemptions in requests.jsonl are those steps.jsonl lists.
"""

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import policies
from orca_jax.runner.experiment import run_policy
from orca_jax.runner.spec import ClusterSpec, LimitsSpec, RunSpec, WorkloadSpec

REPO = Path(__file__).resolve().parents[1]
# smartspec needs an engine that speculates, on one replica (tests/test_smartspec.py).
BUILTIN = sorted(name for name, cls in policies.registered_policies().items()
                 if cls.__module__.startswith("policies.") and name not in ("ltr", "smartspec"))
EXAMPLES = [f"{REPO}/examples/least_attained_service.py:LeastAttainedService",
            f"{REPO}/examples/preemptive_las.py:PreemptiveLAS",
            f"{REPO}/examples/slo_admission.py:SLOAdmission"]


def _spec(seed: int, num_kv_pages: int, max_num_seqs: int, routers: int) -> RunSpec:
    return RunSpec(
        workload=WorkloadSpec(num_requests=24, rate=32.0, prompt_len="uniform:1:40",
                              output_len="uniform:1:64"),
        limits=LimitsSpec(num_kv_pages=num_kv_pages, page_size=2, max_num_seqs=max_num_seqs,
                          max_model_len=300, log_step_requests=True),
        cluster=ClusterSpec(num_prefill_replicas=1, num_decode_replicas=routers),
        seed=seed, ttft_slo_s=1.0)


def _check(out: Path) -> None:
    requests = [json.loads(line) for line in open(out / "requests.jsonl")]
    steps = [json.loads(line) for line in open(out / "steps.jsonl")]
    for row in requests:
        if row["status"] == "rejected":  # up front: too long for the context or the pool
            assert row["reason"] and row["num_generated"] == 0, row
            continue
        assert row["status"] == "finished", row
        assert row["num_generated"] == row["output_len"], row
    logged = sum(len(step.get("preempted_ids", [])) for step in steps)
    assert logged == sum(row["num_preemptions"] for row in requests)


@pytest.mark.parametrize("policy", BUILTIN + EXAMPLES)
@settings(max_examples=4, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), num_kv_pages=st.sampled_from([40, 64]),
       max_num_seqs=st.sampled_from([2, 4]), decode_replicas=st.sampled_from([1, 2]))
def test_kv_tight_decode_pools_end_with_every_request_served(policy, seed, num_kv_pages,
                                                             max_num_seqs, decode_replicas,
                                                             tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "out"
    options = {"kv_reservation": "exact"} if policy in ("static", "orca") else {}
    summary, result = run_policy(_spec(seed, num_kv_pages, max_num_seqs, decode_replicas),
                                 policy, options, out_dir=str(out), progress=False)
    assert summary["num_finished"] + summary["num_rejected"] == 24
    _check(out)


def test_the_issue_s_deadlock_case_finishes():
    # The soak's first command: sjf on a 40-page decode pool of 2-token pages, batch cap 2.
    spec = RunSpec(
        workload=WorkloadSpec(num_requests=30, rate=32.0, prompt_len="uniform:1:40",
                              output_len="uniform:1:64"),
        limits=LimitsSpec(num_kv_pages=40, page_size=2, max_num_seqs=2, max_model_len=300),
        cluster=ClusterSpec(num_prefill_replicas=1, num_decode_replicas=1))
    for policy in ("sjf", "mlfq", "vtc", "vllm"):
        summary, _ = run_policy(spec, policy, {}, progress=False)
        # 6 of the 30 need more than the pool's 40 pages: rejected up front.
        assert (summary["num_finished"], summary["num_rejected"]) == (24, 6), policy


def test_static_in_a_decode_pool_keeps_the_kv_rule():
    # The soak's static case: its transfers take each request's reservation up front, so
    # no request waits in the decode pool holding part of what its admission needs.
    spec = RunSpec(
        workload=WorkloadSpec(num_requests=40, rate=50.0, prompt_len="uniform:1:20",
                              output_len="uniform:1:20"),
        limits=LimitsSpec(num_kv_pages=4, page_size=32, max_num_seqs=32, max_num_tokens=8,
                          max_model_len=300),
        cluster=ClusterSpec(num_prefill_replicas=1, num_decode_replicas=1))
    summary, _ = run_policy(spec, "static", {"kv_reservation": "exact"}, progress=False)
    assert summary["num_finished"] == 40
