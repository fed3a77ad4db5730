"""The `chain` router (llm-d's filter → score → pick): its stages as plugins, by name and by
path, and what it refuses (a NaN score) in one line, before the request is routed."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import policies
from orca_jax import KVConfig, SchedulerConfig, StepLimits
from orca_jax.cluster.replicas import Cluster
from orca_jax.cluster.routing import ClusterView, make_router
from orca_jax.core.api.policy import PolicyLoadError
from orca_jax.core.plans.plan import PlanError
from orca_jax.core.step.sampling import SamplingConfig
from orca_jax.sim.cost_model import CostModelConfig
from orca_jax.sim.engine import SimEngine
from orca_jax.workloads.synthetic import synthetic_workload
from policies.router_chain import Chain

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = f"{REPO}/examples/predicted_latency_scorer.py:PredictedTTFT"
CONFIG = SchedulerConfig(limits=StepLimits(max_num_seqs=8, max_num_tokens=256, max_model_len=512),
                         kv=KVConfig(num_kv_pages=160, page_size=16))


def _engine():
    return SimEngine(CostModelConfig(mode="fixed", model="tiny", step_time_s=0.01))


def _workload(n=80, rate=300.0, seed=3):
    return synthetic_workload(num_requests=n, arrival="poisson", rate=rate,
                              prompt_len="uniform:8:200", output_len="uniform:1:80", seed=seed)


def _cluster(requests, num_replicas, router, *, seed=0, **options):
    config = dataclasses.replace(CONFIG, sampling=SamplingConfig(seed=seed))
    return Cluster(requests, num_replicas=num_replicas, router=router,
                   make_policy=lambda: policies.make_policy("vllm"), make_engine=_engine,
                   config=config, router_options={k: str(v) for k, v in options.items()})


@dataclasses.dataclass
class RecordingChain(Chain):
    """chain that records each decision's loads, candidates, summed scores and choice."""

    seen: list = dataclasses.field(default_factory=list)

    def route(self, view: ClusterView, request: int) -> int:
        candidates = self.candidates(view, request)
        scores = self.scores(view, request, candidates)
        choice = super().route(view, request)
        self.seen.append((view.outstanding().copy(), candidates, scores, choice))
        return choice


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_chain_never_picks_a_replica_its_filter_dropped(seed):
    # A random picker piles requests up, so the bound of 2 often drops some replicas, and
    # sometimes all of them.
    router = RecordingChain(filters="load_bound", scorers="kv_usage", picker="random",
                            stage_opts="load_bound.max_outstanding=2")
    result = _cluster(_workload(rate=20.0, seed=seed), 4, router, seed=seed).run()
    filtered = everyone = 0
    for load, candidates, _, choice in router.seen:
        under = np.flatnonzero(load < 2)
        if under.size:  # the filter's candidates, and the choice among them
            np.testing.assert_array_equal(candidates, under)
            assert load[choice] < 2
            filtered += under.size < 4
        else:  # every replica over the bound: the filter is passed over
            np.testing.assert_array_equal(candidates, np.arange(4))
            everyone += 1
    assert filtered > 20 and everyone > 10  # both cases, often enough to matter
    assert set(result.replica.tolist()) == {0, 1, 2, 3}


def test_queue_and_max_pick_the_least_loaded_and_weights_trade_scorers():
    router = RecordingChain()  # scorers=queue, picker=max
    _cluster(_workload(), 3, router).run()
    for load, candidates, scores, choice in router.seen:
        assert load[choice] == load.min()
        spread = load.max() - load.min()
        np.testing.assert_allclose(scores, 1.0 if spread == 0 else (load.max() - load) / spread)
    # A weighted sum: 2 * queue + kv_usage, each in [0, 1].
    mixed = RecordingChain(scorers="queue*2+kv_usage")
    _cluster(_workload(), 3, mixed).run()
    assert all(0 <= s.min() and s.max() <= 3 for _, _, s, _ in mixed.seen)
    assert any(s.max() > 2 for _, _, s, _ in mixed.seen)


def test_a_scorer_loads_by_path_with_its_knobs():
    for stage in ("predictedttft", EXAMPLE):  # its options by its name or as written
        router = make_router("chain", {"scorers": EXAMPLE,
                                       "stage_opts": f"{stage}.prefill_tokens_per_s=20000"})
        (scorer,) = [s for s in router.stages if s.kind == "scorer"]
        assert scorer.name == "predictedttft" and scorer.prefill_tokens_per_s == 20000
    router = RecordingChain(scorers=EXAMPLE)
    result = _cluster(_workload(), 3, router).run()
    for _, candidates, scores, choice in router.seen:
        assert scores.max() <= 0 and scores[list(candidates).index(choice)] == scores.max()
    assert set(result.replica.tolist()) == {0, 1, 2}


NAN_SCORER = """
import dataclasses
import json
import numpy as np
from orca_jax.cluster.routing import RouteScorer

@dataclasses.dataclass
class NaNScorer(RouteScorer):
    def score(self, view, request, replicas):
        scores = np.ones(replicas.size)
        scores[replicas == 1] = np.nan
        return scores
"""


def test_a_nan_score_is_refused_before_the_request_is_routed(tmp_path):
    path = tmp_path / "nan_scorer.py"
    path.write_text(NAN_SCORER)
    cluster = _cluster(_workload(n=6), 2, "chain", scorers=f"queue+{path}:NaNScorer")
    with pytest.raises(PlanError) as caught:
        cluster.run()
    assert str(caught.value) == (
        "router 'chain' broke rule 'score_not_finite': scorer 'nanscorer' gave nan for replica "
        "1 (request 0); scores must be finite numbers")
    assert caught.value.kind == "router"
    table = cluster.replicas[0].table
    assert (table.holder == -1).all()  # the first arrival was refused: nothing was routed
    assert all(r.view.waiting.size == r.view.running.size == r.view.step_index == 0
               for r in cluster.replicas)  # and no replica has stepped


def test_a_nan_score_on_the_command_line_is_one_line(tmp_path):
    path = tmp_path / "nan_scorer.py"
    path.write_text(NAN_SCORER)
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "experiments.run", "--engine=sim", "--policy=vllm",
         "--num_requests=10", "--num_replicas=2", "--router=chain",
         f"--router_opts=scorers={path}:NaNScorer", f"--out_dir={out}"],
        cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
        timeout=300)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "error: router 'chain' broke rule 'score_not_finite': scorer 'nanscorer' gave nan for "
        "replica 1 (request 0); scores must be finite numbers")
    assert len(result.stderr.strip().splitlines()) == 1
    # Nothing half-run is left: no results folder, no staging folder beside it.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nan_scorer.py"]


def test_bad_stages_and_options_are_one_line_naming_them():
    for options, message in (
            ({"scorers": "qeue"}, "router 'chain': unknown scorer 'qeue'; registered scorers: "
                                  "kv_usage, prefix_cache, queue"),
            ({"filters": "queue"}, "unknown filter 'queue'; registered filters: kv_headroom, "
                                   "load_bound"),
            ({"picker": "argmax"}, "unknown picker 'argmax'; registered pickers: max, random, "
                                   "softmax"),
            ({"scorers": "queue*x"}, "scorer 'queue\\*x': weight 'x' is not a finite number"),
            ({"scorers": "queue*nan"}, "weight 'nan' is not a finite number"),
            ({"scorers": ""}, "scorers is empty"),
            ({"stage_opts": "softmax.temperature=1"}, "stage_opts names 'softmax', not a stage "
                                                      "of this chain \\(queue, max\\)"),
            ({"stage_opts": "temperature=1"}, "'temperature=1' is not stage.knob=value"),
            ({"filters": "load_bound", "stage_opts": "load_bound.max_outstanding=0"},
             "filter 'load_bound': max_outstanding must be >= 1, got 0"),
            ({"stage_opts": "queue.x=1"}, "scorer 'queue' has no option 'x'"),
            ({"scorers": f"{EXAMPLE[:-len(':PredictedTTFT')]}"},
             "names a file but no class.*:PredictedTTFT")):
        with pytest.raises(PolicyLoadError, match=message):
            make_router("chain", options)


def test_the_softmax_picker_is_max_at_temperature_0_and_spreads_above_it():
    def choices(temperature, seed=0):
        router = make_router("chain", {"scorers": "kv_usage", "picker": "softmax",
                                       "stage_opts": f"softmax.temperature={temperature}"})
        return _cluster(_workload(), 3, router, seed=seed).run().replica

    cold = RecordingChain(scorers="kv_usage", picker="softmax",
                          stage_opts="softmax.temperature=0")
    _cluster(_workload(), 3, cold).run()
    assert all(s[list(c).index(choice)] == s.max() for _, c, s, choice in cold.seen)
    hot = choices(100.0)
    assert np.bincount(hot, minlength=3).min() > 15  # near uniform over 80 requests
    np.testing.assert_array_equal(choices(100.0), hot)  # seeded
    assert (choices(100.0, seed=1) != hot).any()


def test_describe_policy_prints_a_stage_s_knobs_and_where_they_go():
    result = subprocess.run(
        [sys.executable, "-m", "experiments.run", f"--describe_policy={EXAMPLE}"],
        cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
        timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("scorer 'predictedttft' (") and "time to first token" in lines[0]
    assert lines[1] == ("knobs (the chain router's "
                        "--router_opts=stage_opts=predictedttft.key=value;...):")
    assert lines[2] == "  prefill_tokens_per_s: float = 10000.0"


def test_config_json_holds_each_stage_with_its_resolved_knobs(tmp_path):
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "experiments.run", "--engine=sim", "--policy=vllm",
         "--num_requests=10", "--num_replicas=2", "--router=chain",
         "--router_opts=filters=load_bound,scorers=queue*2+prefix_cache,picker=softmax,"
         "stage_opts=softmax.temperature=0.5", f"--out_dir={out}"],
        cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
        timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    router = json.loads((out / "config.json").read_text())["router"]
    assert router["scorers"] == "queue*2+prefix_cache"
    assert router["stages"] == [
        {"kind": "filter", "name": "load_bound", "max_outstanding": 64},  # its default
        {"kind": "scorer", "name": "queue"}, {"kind": "scorer", "name": "prefix_cache"},
        {"kind": "picker", "name": "softmax", "temperature": 0.5}]
