"""The run's prefix-caching switch (`--prefix_caching`, `KVConfig.prefix_caching`): `on`
caches for every built-in policy and each keeps the plan rules with shared pages, `off`
caches for none, `policy` (the default) is each policy's own opt-in as before (the frozen
digests hold that bit for bit), and a contradiction or a policy that cannot share pages
is refused in one line."""

import dataclasses
import json
import warnings

import numpy as np
import pytest
from cli_runner import run_module
from hypothesis import given, settings
from test_disaggregated_invariants import _check as check_run_folder
from test_scheduler_invariants import (
    BUILTIN_POLICIES,
    EXAMPLE_PLUGINS,
    build_cached,
    check_outcome,
    policy_options,
    run_checked_with_cache,
    shared_prefix_workloads,
    sim_engine,
)

from experiments.run import describe
from orca_jax import (
    KVConfig,
    Request,
    Scheduler,
    SchedulerConfig,
    SchedulerView,
    StepLimits,
    StepPlan,
)
from orca_jax.core.api.plugins import PolicyLoadError
from orca_jax.core.api.policy import Policy, make_policy
from orca_jax.runner.build import check_prefix_caching
from orca_jax.runner.experiment import run_policy
from orca_jax.runner.settings import effective_settings
from orca_jax.runner.spec import ClusterSpec, LimitsSpec, RunSpec, SimEngineSpec, WorkloadSpec


@pytest.mark.parametrize("policy_name", BUILTIN_POLICIES + EXAMPLE_PLUGINS)
@settings(max_examples=8, deadline=None, derandomize=True)
@given(run=shared_prefix_workloads())
def test_on_holds_every_policy_to_the_invariants_with_shared_pages(policy_name, run):
    # Few prefixes, many requests, a tiny pool: hits, evictions and preemptions of shared
    # pages. Every step keeps the budget, the cap and the KV rule (reference counts
    # included); a bad plan changes nothing; every request finishes with its output.
    requests, config = run
    scheduler = Scheduler(requests, build_cached(policy_name, opted_in=False), sim_engine(),
                          config.with_knobs(prefix_caching="on"))
    assert scheduler.prefix_caching and scheduler.view.prefix_caching
    run_checked_with_cache(scheduler)
    check_outcome(scheduler)
    assert (scheduler.kv.ref_count == 0).all()  # every shared page went with its last holder


def _shared_prefix_spec(mode: str, **cluster) -> RunSpec:
    # 8 system prompts of 256 tokens before short suffixes, Zipf-popular: most admissions
    # find their prefix cached, in a pool small enough that caching changes the run.
    return RunSpec(
        workload=WorkloadSpec(arrival="shared_prefix", num_requests=60, rate=40.0,
                              prefix_len="fixed:256", suffix_len="uniform:16:64",
                              output_len="uniform:1:32"),
        engine=SimEngineSpec(step_time_ms=5.0),
        limits=LimitsSpec(max_num_seqs=16, max_num_tokens=512, num_kv_pages=400,
                          max_model_len=1024, prefix_caching=mode),
        cluster=ClusterSpec(**cluster))


@pytest.mark.parametrize("policy_name", BUILTIN_POLICIES)
def test_on_gives_every_builtin_prefix_hits_and_finishes_every_request(policy_name, tmp_path):
    out = tmp_path / "run"
    spec = _shared_prefix_spec("on")
    summary, _ = run_policy(spec, policy_name, policy_options(policy_name), out_dir=str(out),
                            progress=False)
    assert summary["num_finished"] == 60
    assert summary["prefix_hit_rate"] > 0.3, summary["prefix_hit_rate"]
    check_run_folder(out)  # each finished with its output; preemptions logged
    assert json.loads((out / "config.json").read_text())["settings"]["prefix_caching"] is True


def test_off_caches_for_no_policy_and_policy_keeps_each_policy_s_own_opt_in(tmp_path):
    off, _ = run_policy(_shared_prefix_spec("off"), "vllm", {}, progress=False)
    assert off["num_finished"] == 60 and "prefix_hit_rate" not in off
    default, _ = run_policy(_shared_prefix_spec("policy"), "vllm", {}, progress=False)
    assert default["prefix_hit_rate"] > 0.3  # vllm opts in by default
    orca, _ = run_policy(_shared_prefix_spec("policy"), "orca", {}, progress=False)
    assert "prefix_hit_rate" not in orca  # orca does not
    assert LimitsSpec().prefix_caching == "policy" and KVConfig().prefix_caching == "policy"
    config = SchedulerConfig()
    active = {name: effective_settings(make_policy(name, policy_options(name)),
                                       config)["prefix_caching"] for name in BUILTIN_POLICIES}
    assert {name for name, on in active.items() if on} == {"atlas", "continuum", "lpm", "plas",
                                                          "smartspec", "vllm", "vllm-priority"}
    for mode, expected in (("on", True), ("off", False)):
        config = SchedulerConfig(kv=KVConfig(prefix_caching=mode))
        assert {effective_settings(make_policy(name, policy_options(name)),
                                   config)["prefix_caching"] for name in BUILTIN_POLICIES} == {
            expected}


@pytest.mark.parametrize("policy_name", ["orca", "sarathi", "sjf", "vllm"])
def test_on_in_a_disaggregated_run_caches_in_the_prefill_pool(policy_name, tmp_path):
    out = tmp_path / "run"
    options = {"kv_reservation": "exact"} if policy_name == "orca" else {}
    spec = _shared_prefix_spec("on", num_prefill_replicas=1, num_decode_replicas=1)
    summary, _ = run_policy(spec, policy_name, options, out_dir=str(out), progress=False)
    assert summary["num_finished"] == 60
    assert summary["prefix_hit_rate"] > 0.3
    check_run_folder(out)


def test_a_knob_given_against_the_switch_is_refused_in_one_line():
    off = SchedulerConfig(kv=KVConfig(prefix_caching="off"))
    on = SchedulerConfig(kv=KVConfig(prefix_caching="on"))
    with pytest.raises(PolicyLoadError, match=r"^policy 'vllm': option enable_prefix_caching="
                       r"true contradicts --prefix_caching=off"):
        options = {"enable_prefix_caching": "true"}
        check_prefix_caching(make_policy("vllm", options), options, off)
    options = {"enable_prefix_caching": "false"}
    with pytest.raises(PolicyLoadError, match="contradicts --prefix_caching=on"):
        check_prefix_caching(make_policy("vllm", options), options, on)
    # In agreement, at its default, or under `policy`: accepted.
    check_prefix_caching(make_policy("vllm", options), options, off)
    check_prefix_caching(make_policy("vllm"), {}, off)
    check_prefix_caching(make_policy("vllm", options), options, SchedulerConfig())


def test_the_command_refuses_the_contradiction_with_exit_2_and_one_line(tmp_path):
    result = run_module("experiments.run", "--engine=sim", "--policy=vllm",
                        "--policy_opts=enable_prefix_caching=true", "--prefix_caching=off",
                        f"--out_dir={tmp_path / 'out'}", check=False)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--prefix_caching=off" in lines[0], result.stderr
    assert not (tmp_path / "out").exists()


@dataclasses.dataclass(kw_only=True)
class WholePrompts(Policy):
    """A plugin that cannot plan past a cache hit, and says why."""

    name = "test_whole_prompts"
    prefix_caching_unsupported = "it computes every prompt whole, for its own accounting"

    def schedule(self, view: SchedulerView) -> StepPlan:
        return StepPlan(view.waiting[:1], view.requests.num_uncomputed(view.waiting[:1]))


def test_on_refuses_a_policy_that_cannot_share_pages_naming_it_and_its_reason():
    requests = [Request(id=i, arrival_s=0.0, prompt_len=20, output_len=4,
                        prompt_tokens=np.arange(20, dtype=np.int32)) for i in range(3)]
    config = SchedulerConfig(limits=StepLimits(max_model_len=64))
    on = config.with_knobs(prefix_caching="on")
    with pytest.raises(ValueError, match=r"policy 'test_whole_prompts' cannot run with "
                       r"prefix_caching 'on': it computes every prompt whole"):
        Scheduler(requests, WholePrompts(), sim_engine(), on)
    with pytest.raises(PolicyLoadError, match="test_whole_prompts"):
        check_prefix_caching(WholePrompts(), {}, on)
    for mode in ("policy", "off"):  # it never caches there: it runs
        Scheduler(requests, WholePrompts(), sim_engine(), config.with_knobs(prefix_caching=mode))
    assert "not supported (it computes every prompt whole" in describe(
        f"{__file__}:WholePrompts")


def test_compare_with_on_shows_caching_on_for_each_and_no_caching_warning(tmp_path):
    out = tmp_path / "cmp"
    common = ("experiments.compare", "--policies=vllm,sarathi,orca", "--engine=sim",
              "--workload=shared_prefix", "--num_requests=40", "--step_time_ms=5",
              "--policy_opts=sarathi.max_num_tokens=2048")
    run_module(*common, "--prefix_caching=on", f"--out_dir={out}")
    head = (out / "comparison.txt").read_text().split("\npolicy ")[0]
    assert "warning:" not in head, head
    rows = json.loads((out / "comparison.json").read_text())
    assert {row["policy"]: row["prefix_caching"] for row in rows} == {
        "vllm": True, "sarathi": True, "orca": True}
    assert all(row["prefix_hit_rate"] > 0 for row in rows)
    # The same command without the switch compares a cached vllm with uncached others.
    run_module(*common, f"--out_dir={tmp_path / 'default'}")
    head = (tmp_path / "default" / "comparison.txt").read_text().split("\npolicy ")[0]
    assert "prefix_caching (vllm=on, sarathi=off, orca=off)" in head


def test_describe_policy_says_what_each_does_with_caching():
    assert "does not opt in" in describe("orca")
    assert "opts in by its knob enable_prefix_caching (default True)" in describe("vllm")
    assert "prefix caching: opts in," in describe("lpm")


def test_buddy_layout_and_on_are_refused_together():
    with pytest.raises(ValueError, match="limits.prefix_caching 'on'.*'buddy'"):
        LimitsSpec(kv_layout="buddy", prefix_caching="on")
    with pytest.raises(ValueError, match="kv.prefix_caching 'on'.*'buddy'"):
        KVConfig(kv_layout="buddy", prefix_caching="on")
    with pytest.raises(ValueError, match="prefix_caching 'sometimes' is not one of"):
        KVConfig(prefix_caching="sometimes")


def test_0_2_s_boolean_knob_maps_onto_the_switch_with_a_warning():
    with pytest.warns(DeprecationWarning, match="prefix_caching='off'"):
        assert KVConfig(enable_prefix_caching=False).prefix_caching == "off"
    with pytest.warns(DeprecationWarning, match="prefix_caching='policy'"):
        assert SchedulerConfig().with_knobs(
            enable_prefix_caching=True).kv.prefix_caching == "policy"
    with pytest.warns(DeprecationWarning, match="read KVConfig.prefix_caching"):
        assert KVConfig(prefix_caching="off").enable_prefix_caching is False
    with warnings.catch_warnings(), pytest.raises(TypeError, match="give only prefix_caching"):
        warnings.simplefilter("ignore")
        KVConfig(enable_prefix_caching=True, prefix_caching="on")


@settings(max_examples=60, deadline=None, derandomize=True)
@given(run=shared_prefix_workloads())
def test_sarathi_counts_a_shared_page_freed_only_with_its_last_holder(run):
    # Its preemption pass once counted each victim's held pages as freed; a page another
    # running request shares is not, and the plan broke the KV rule (found at ~40 cases).
    requests, config = run
    scheduler = Scheduler(requests, make_policy("sarathi"), sim_engine(),
                          config.with_knobs(prefix_caching="on"))
    run_checked_with_cache(scheduler)
    check_outcome(scheduler)
