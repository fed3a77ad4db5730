"""Version 0.2.0 in both places; 0.1 scripts (flat RunSpec, policies._common.plan_in_order)
still run, with a DeprecationWarning, and give what the 0.2 spelling gives."""

from __future__ import annotations

import configparser
import warnings
from pathlib import Path

import numpy as np
import pytest

import orca_jax
from orca_jax.cluster import routing
from orca_jax.runner.experiment import run_policy
from orca_jax.runner.spec import (
    ClusterSpec,
    JaxEngineSpec,
    LimitsSpec,
    RunSpec,
    SimEngineSpec,
    WorkloadSpec,
)

ROOT = Path(__file__).resolve().parents[1]


def test_setup_cfg_and_the_package_say_the_same_version():
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    assert setup["metadata"]["version"] == orca_jax.__version__ == "0.2.0"


def test_the_router_api_is_at_the_package_face():
    assert orca_jax.Router is routing.Router
    assert orca_jax.ClusterView is routing.ClusterView
    assert orca_jax.register_router is routing.register_router
    assert {"Router", "ClusterView", "register_router"} <= set(orca_jax.__all__)


def test_the_old_cluster_module_s_names_are_the_cluster_package_s():
    """`orca_jax.cluster` loads `replicas` when one of its names is first asked for: the
    package's list of them is the module's, and each is the module's object."""
    import orca_jax.cluster
    from orca_jax.cluster import replicas
    assert orca_jax.cluster.__all__ == replicas.__all__
    for name in replicas.__all__:
        assert getattr(orca_jax.cluster, name) is getattr(replicas, name)
    namespace: dict = {}
    exec("from orca_jax.cluster import *", namespace)
    assert set(replicas.__all__) <= set(namespace)
    with pytest.raises(AttributeError, match="no attribute 'Clustr'"):
        orca_jax.cluster.Clustr


def test_a_flat_0_1_run_spec_warns_and_builds_the_nested_spec():
    with pytest.warns(DeprecationWarning, match=r"0\.1's flat keywords are deprecated.*"
                      r"workload=WorkloadSpec\(arrival=\.\.\., rate=\.\.\."):
        old = RunSpec(engine="sim", workload="gamma", rate=8.0, cv=2.0, num_requests=40,
                      max_batch_size=16, token_budget=512, page_size=8, hardware="h100",
                      num_replicas=2, router="least_outstanding", seed=3, ttft_slo_s=0.5)
    assert old == RunSpec(
        workload=WorkloadSpec(arrival="gamma", rate=8.0, cv=2.0, num_requests=40),
        engine=SimEngineSpec(hardware="h100"),
        limits=LimitsSpec(max_num_seqs=16, max_num_tokens=512, page_size=8),
        cluster=ClusterSpec(num_replicas=2, router="least_outstanding"),
        seed=3, ttft_slo_s=0.5)


def test_a_flat_spec_keeps_0_1s_engine_choice_and_ignores_the_other_engines_settings():
    with pytest.warns(DeprecationWarning, match=r"hardware ignored: not settings of engine "
                      r"'jax'"):
        old = RunSpec(engine="jax", model="tiny", clock="wall", hardware="a100")
    assert old.engine == JaxEngineSpec(model="tiny", clock="wall")


def test_a_nested_spec_and_replace_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        spec = RunSpec(workload=WorkloadSpec(rate=2.0), seed=1)
        assert spec.workload.rate == 2.0


def test_flat_keywords_beside_nested_parts_are_refused_by_name():
    with pytest.raises(TypeError, match=r"'limits' is no field of 0\.1's flat RunSpec, beside "
                       r"its flat keywords \['rate'\]"):
        RunSpec(limits=LimitsSpec(), rate=3.0)
    with pytest.raises(TypeError, match="'max_num_seqs' is no field"):
        RunSpec(engine="sim", max_num_seqs=8)


def test_an_old_style_script_runs_with_the_warning_and_matches_the_new_style(tmp_path):
    with pytest.warns(DeprecationWarning):
        old_spec = RunSpec(engine="sim", num_requests=30, rate=20.0, max_batch_size=8,
                           token_budget=256, prompt_len="uniform:8:64",
                           output_len="uniform:4:16", seed=5)
    new_spec = RunSpec(workload=WorkloadSpec(num_requests=30, rate=20.0,
                                             prompt_len="uniform:8:64",
                                             output_len="uniform:4:16"),
                       limits=LimitsSpec(max_num_seqs=8, max_num_tokens=256), seed=5)
    old_summary, old_result = run_policy(old_spec, "orca", progress=False)
    new_summary, new_result = run_policy(new_spec, "orca", progress=False)
    assert old_summary["num_finished"] == new_summary["num_finished"] == 30
    assert old_summary["num_steps"] == new_summary["num_steps"]
    assert old_summary["duration_s"] == new_summary["duration_s"]


def test_plan_in_order_from_policies_common_warns_and_is_the_public_one():
    import policies._common as common

    with pytest.warns(DeprecationWarning, match=r"policies\._common\.plan_in_order is "
                      r"deprecated.*use orca_jax\.plan_in_order"):
        old = common.plan_in_order
    assert old is orca_jax.plan_in_order
    with pytest.raises(AttributeError, match="no attribute 'plan_in_ordr'"):
        common.plan_in_ordr  # noqa: B018  (a typo still fails, by name)


def test_an_old_plugin_ranking_by_plan_in_order_gives_the_new_ones_steps():
    import policies._common as common

    with pytest.warns(DeprecationWarning):
        old_plan_in_order = common.plan_in_order

    class OldFcfs(orca_jax.Policy):
        name = "old_fcfs"

        def schedule(self, view):
            order = np.concatenate([view.running, view.waiting])
            return old_plan_in_order(view, order)

    class NewFcfs(OldFcfs):
        name = "new_fcfs"

        def schedule(self, view):
            return orca_jax.plan_in_order(view, np.concatenate([view.running, view.waiting]))

    spec = RunSpec(workload=WorkloadSpec(num_requests=20, rate=50.0, prompt_len="uniform:8:64",
                                         output_len="uniform:4:16"),
                   limits=LimitsSpec(max_num_seqs=4, max_num_tokens=128, num_kv_pages=24))
    from orca_jax.runner.build import build_engine, build_workload, scheduler_config

    steps = []
    for policy in (OldFcfs(), NewFcfs()):
        config = scheduler_config(spec)
        result = orca_jax.Scheduler(build_workload(spec), policy, build_engine(spec, config),
                                    config).run()
        steps.append([(s.num_tokens, s.num_seqs) for s in result.steps])
    assert steps[0] == steps[1] and len(steps[0]) > 20
