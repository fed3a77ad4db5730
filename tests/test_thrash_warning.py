"""A run that thrashes warns once, early, and its summary says how much it threw away."""

import dataclasses
import logging

import pytest

from orca_jax.results.thrash import MIN_PREEMPTIONS, thrash_warning
from orca_jax.runner.experiment import run_policy
from orca_jax.runner.spec import LimitsSpec, RunSpec, SimEngineSpec, WorkloadSpec
from tests.cli_runner import REPO

THRASH = str(REPO / "tests/plugins/thrashing_policy.py") + ":FlipFlop"
# 200 short requests at once on a pool of 24 pages of 8 tokens (192 tokens: about four
# requests' contexts), so admissions need pages running requests hold.
SPEC = RunSpec(workload=WorkloadSpec(arrival="burst", num_requests=200,
                                     prompt_len="uniform:16:64", output_len="uniform:8:32"),
               engine=SimEngineSpec(step_time_ms=5.0),
               limits=LimitsSpec(max_num_seqs=8, max_num_tokens=512, num_kv_pages=24,
                                 page_size=8, max_model_len=128), seed=4)


def _run(policy, caplog, options=None, spec=SPEC):
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        summary, result = run_policy(spec, policy, options, progress=False)
    lines = [r.getMessage() for r in caplog.records if "may be thrashing" in r.getMessage()]
    return summary, result, lines


def _recomputed(result):
    """Tokens the steps computed beyond each request's own (prompt, and every output token
    but the last, which no step computes): the work preemptions threw away."""
    assert (result.num_generated == result.output_len).all()  # every request finished
    own = int((result.prompt_len + result.num_generated - 1).sum())
    return int(result.step_array("num_tokens").sum()) - own


def test_a_thrashing_plugin_warns_once_early_and_its_summary_counts_the_waste(caplog):
    summary, result, lines = _run(THRASH, caplog)
    assert len(lines) == 1, lines
    # Early: the line names the step it came at, long before the run's last.
    at_step = int(lines[0].split(" steps (thresholds")[0].rsplit(" ", 1)[1])
    assert at_step <= 256 < result.num_steps
    assert "admission_preempts=False" in lines[0]
    assert summary["num_finished"] == 200
    assert summary["preemptions_per_finished"] == summary["num_preemptions"] / 200 > 1
    assert summary["recomputed_tokens"] == _recomputed(result) > 0
    computed = int(result.step_array("num_tokens").sum())
    assert summary["recomputed_token_fraction"] == pytest.approx(
        summary["recomputed_tokens"] / computed)
    assert summary["recomputed_token_fraction"] > 0.5


@pytest.mark.parametrize("policy, options", [("vllm", None),
                                             (THRASH, {"admission_preempts": "false"})])
def test_preempting_within_reason_does_not_warn(policy, options, caplog):
    # vllm preempts on this pool too, and so does the flip-flop ranking once admissions
    # may no longer preempt; neither throws most of its work away. 300 requests: enough
    # preemptions (100) for the figures to be judged.
    spec = dataclasses.replace(SPEC, workload=dataclasses.replace(SPEC.workload,
                                                                  num_requests=300))
    summary, result, lines = _run(policy, caplog, options, spec)
    assert lines == []
    assert summary["num_preemptions"] >= MIN_PREEMPTIONS
    assert summary["recomputed_tokens"] == _recomputed(result) > 0
    assert summary["preemptions_per_finished"] < 1
    assert summary["recomputed_token_fraction"] < 0.5


def test_summary_of_a_run_without_preemptions():
    spec = RunSpec(workload=WorkloadSpec(arrival="burst", num_requests=8,
                                         prompt_len="fixed:16", output_len="fixed:4"),
                   engine=SimEngineSpec(step_time_ms=5.0), seed=1)
    summary, _ = run_policy(spec, "vllm", progress=False)
    assert summary["num_preemptions"] == 0 and summary["recomputed_tokens"] == 0
    assert summary["preemptions_per_finished"] == 0.0
    assert summary["recomputed_token_fraction"] == 0.0


@pytest.mark.parametrize("preemptions, finished, recomputed, computed, warns", [
    (99, 0, 10**6, 10**6, False),  # too few preemptions to judge
    (100, 100, 50, 100, False),  # one per finished request, half recomputed: at the line
    (101, 100, 0, 100, True),  # past one preemption per finished request
    (150, 0, 0, 100, True),  # fewer than 100 finished count as 100
    (100, 0, 0, 100, False),
    (100, 500, 51, 100, True),  # past half the tokens recomputed
])
def test_thresholds(preemptions, finished, recomputed, computed, warns):
    line = thrash_warning("p", num_preemptions=preemptions, num_finished=finished,
                          recomputed_tokens=recomputed, computed_tokens=computed, num_steps=7)
    assert (line is not None) == warns
    if warns:
        assert line.startswith("run p may be thrashing") and "\n" not in line


@pytest.mark.parametrize("admission_preempts, warns", [("false", False), ("true", True)])
def test_the_guides_preempting_example_thrashes_only_when_admissions_preempt(
        admission_preempts, warns, caplog):
    summary, _, lines = _run(str(REPO / "examples/preemptive_las.py") + ":PreemptiveLAS",
                             caplog, {"admission_preempts": admission_preempts})
    assert summary["policy"] == "preemptive_las" and summary["num_finished"] == 200
    assert len(lines) == int(warns)
    assert (summary["preemptions_per_finished"] > 1) == warns


def test_the_guide_quotes_the_preempting_example_as_it_is():
    doc = (REPO / "docs/writing_a_policy.md").read_text()
    quoted = doc.split("```python\n@register(\"preemptive_las\")", 1)[1].split("```", 1)[0]
    text = (REPO / "examples/preemptive_las.py").read_text()
    for line in ('@register("preemptive_las")\n' + quoted).splitlines():
        assert line in text.splitlines(), line
