"""Elastic replicas: a planner's count within its caps, start-up delays, draining, the
replica-seconds of the timeline, the built-in planners' arithmetic, refusals."""

import dataclasses
import json
import math

import numpy as np
import pytest

import policies
from orca_jax import KVConfig, Request, Scheduler, SchedulerConfig, StepLimits
from orca_jax.cluster.elastic import (
    ProfileDescriptorError,
    ScalingSpec,
    profile_replica,
    replica_seconds,
)
from orca_jax.cluster.planning import Planner, PlannerMetrics, ReplicaProfile
from orca_jax.cluster.replicas import Cluster
from orca_jax.core.plans.plan import PlanError
from orca_jax.core.requests.request import RequestState
from orca_jax.sim.cost_model import CostModelConfig
from orca_jax.sim.engine import SimEngine
from orca_jax.workloads.synthetic import synthetic_workload
from orca_jax.workloads.traces import repeat_trace

STEP_S = 0.01
CONFIG = SchedulerConfig(limits=StepLimits(max_num_seqs=8, max_num_tokens=256, max_model_len=512),
                         kv=KVConfig(num_kv_pages=120, page_size=16))


def _engine():
    return SimEngine(CostModelConfig(mode="fixed", model="tiny", step_time_s=STEP_S))


def _cluster(requests, planner, *, num_replicas=1, router="least_outstanding", **scaling):
    spec = ScalingSpec(**{"interval_s": 0.5, "startup_s": 0.3, "min_replicas": 1,
                          "max_replicas": 4, **scaling})
    return Cluster(requests, num_replicas=num_replicas, router=router,
                   make_policy=lambda: policies.make_policy("vllm"), make_engine=_engine,
                   config=CONFIG, planner=planner, scaling=spec)


@dataclasses.dataclass
class RandomCount(Planner):
    """Asks for a random count within the caps at every call."""

    seed: int = 0

    def __post_init__(self):
        self.rng = np.random.default_rng(self.seed)

    def plan(self, metrics):
        return int(self.rng.integers(metrics.min_replicas, metrics.max_replicas + 1))


@dataclasses.dataclass
class Fixed(Planner):
    """Asks for `count` (anything) at every call."""

    count: object = 1

    def plan(self, metrics):
        return self.count


def _workload(seed, n=150, rate=60.0):
    return synthetic_workload(num_requests=n, arrival="poisson", rate=rate,
                              prompt_len="uniform:8:120", output_len="uniform:1:120", seed=seed)


def _windows(timeline):
    """Per replica: [(held_from, ready_from, drain_at, off_at)] from the timeline's events."""
    spans = {}
    for row in timeline:
        r, event, t = row["replica"], row["event"], row["time_s"]
        if r < 0:
            continue
        spans.setdefault(r, [])
        if event == "start":
            spans[r].append([t, None, None, None])
        elif event == "ready":
            if not spans[r] or spans[r][-1][3] is not None:  # ready from the start
                spans[r].append([t, t, None, None])
            else:
                spans[r][-1][1] = t
        elif event == "drain":
            spans[r][-1][2] = t
        elif event == "undrain":
            spans[r][-1][2] = None
        elif event in ("off", "cancel"):
            spans[r][-1][3] = t
    return spans


@pytest.mark.parametrize("seed", range(6))
def test_random_planners_keep_every_invariant(seed):
    rng = np.random.default_rng(100 + seed)
    max_replicas = int(rng.integers(2, 6))
    min_replicas = int(rng.integers(1, max_replicas))  # below the cap: something to scale
    start = int(rng.integers(min_replicas, max_replicas + 1))
    startup = float(rng.choice([0.0, 0.13, 0.7]))
    requests = _workload(seed, rate=float(rng.uniform(20, 120)))
    cluster = _cluster(requests, RandomCount(seed=seed), num_replicas=start,
                       router=str(rng.choice(["round_robin", "least_outstanding",
                                              "power_of_two"])),
                       interval_s=float(rng.uniform(0.1, 0.6)), startup_s=startup,
                       min_replicas=min_replicas, max_replicas=max_replicas)
    result = cluster.run()
    timeline = cluster.elastic.timeline()
    # Every request finished, each on one replica, all its tokens there.
    assert (result.state == RequestState.FINISHED).all()
    np.testing.assert_array_equal(np.bincount(result.token_req, minlength=len(requests)),
                                  [r.output_len for r in requests])
    # The caps: after each instant's changes, ready + starting is the planner's count.
    calls = [row for row in timeline if row["event"] == "plan"]
    assert len(calls) >= 3
    for k, row in enumerate(timeline):
        assert 0 <= row["replicas"] <= max_replicas
        last = k + 1 == len(timeline) or timeline[k + 1]["time_s"] != row["time_s"]
        if last and row["time_s"] >= calls[0]["time_s"]:
            target = [c for c in calls if c["time_s"] <= row["time_s"]][-1]["target"]
            assert row["ready"] + row["starting"] == target
    # Start-up delay: ready exactly startup_s after a start; no request routed to a
    # replica outside its ready window, nor admitted before it was ready.
    spans = _windows(timeline)
    table = cluster.replicas[0].table
    end_s = result.virtual_end_s
    for replica, windows in spans.items():
        for held, ready, drain, off in windows:
            if ready is not None and held != ready:
                assert ready == pytest.approx(held + startup)
        mine = np.flatnonzero(cluster.replica == replica)
        for i in mine:
            arrival = table.arrival_s[i]
            inside = [w for w in windows if w[1] is not None and w[1] <= arrival
                      and (w[2] is None or arrival <= w[2])]
            assert inside, (replica, i, arrival, windows)
            assert table.admitted_s[i] >= inside[-1][1]
            off = inside[-1][3]
            # A drained replica is off only once its requests are done.
            assert off is None or table.finish_s[i] <= off + 1e-12
    # Replica-seconds: the timeline's integral equals each replica's held spans summed.
    held = sum(max(0.0, (end_s if off is None else min(off, end_s)) - min(start, end_s))
               for windows in spans.values() for start, _, _, off in windows)
    assert cluster.elastic.replica_seconds(end_s) == pytest.approx(held)


def test_a_planner_at_the_cap_routes_as_a_static_cluster():
    requests = _workload(7, n=120, rate=80.0)
    static = Cluster(requests, num_replicas=3, router="least_outstanding",
                     make_policy=lambda: policies.make_policy("vllm"), make_engine=_engine,
                     config=CONFIG).run()
    cluster = _cluster(requests, Fixed(count=3), num_replicas=3, max_replicas=3)
    elastic = cluster.run()
    np.testing.assert_array_equal(elastic.finish_s, static.finish_s)
    assert cluster.elastic.replica_seconds(elastic.virtual_end_s) == pytest.approx(
        3 * elastic.virtual_end_s)


def test_a_started_replica_takes_requests_only_once_ready():
    # 1 replica; the planner asks for 2 at its first call (0.5 s); ready at 0.5 + 0.3.
    requests = [Request(id=i, arrival_s=0.05 * i, prompt_len=50, output_len=40)
                for i in range(40)]
    cluster = _cluster(requests, Fixed(count=2), num_replicas=1, router="round_robin")
    cluster.run()
    table = cluster.replicas[0].table
    on_new = np.flatnonzero(cluster.replica == 1)
    assert on_new.size and table.arrival_s[on_new].min() > 0.8
    assert (table.arrival_s[cluster.replica == 0] <= 0.8 + 1e-9).sum() == 17  # 0..0.8 s
    events = [(r["time_s"], r["replica"], r["event"]) for r in cluster.elastic.timeline()
              if r["replica"] == 1]
    assert events == [(0.5, 1, "start"), (pytest.approx(0.8), 1, "ready")]


def test_draining_replicas_finish_their_requests_before_going_off():
    requests = [Request(id=i, arrival_s=0.0, prompt_len=40, output_len=100) for i in range(8)]
    cluster = _cluster(requests, Fixed(count=1), num_replicas=4, router="round_robin",
                       interval_s=0.2)
    cluster.run()
    table = cluster.replicas[0].table
    offs = {r["replica"]: r["time_s"] for r in cluster.elastic.timeline() if r["event"] == "off"}
    assert sorted(offs) == [1, 2, 3]  # the three the planner removed at 0.2 s
    for replica, off in offs.items():
        mine = cluster.replica == replica
        assert off == pytest.approx(table.finish_s[mine].max())
        assert off > 0.2  # their requests (100 tokens at 10 ms) ran past the drain


@pytest.mark.parametrize("count, rule", [(0, "zero_replicas"), (5, "over_max"),
                                         (1, "under_min"), ("3", "not_a_count"),
                                         (True, "not_a_count")])
def test_a_count_outside_the_caps_stops_the_run_naming_the_planner(count, rule):
    cluster = _cluster(_workload(0, n=60), Fixed(count=count), num_replicas=2, min_replicas=2)
    states = cluster.elastic.state.copy()
    with pytest.raises(PlanError) as error:
        cluster.run()
    assert (error.value.kind, error.value.policy, error.value.rule) == ("planner", "fixed", rule)
    assert str(error.value).startswith("planner 'fixed' broke rule")
    np.testing.assert_array_equal(cluster.elastic.state, states)  # nothing changed


PROFILE = ReplicaProfile(batch=np.array([1, 2, 4]), decode_step_s=np.array([0.01, 0.012, 0.016]),
                         prefill_s_per_token=1e-4, prompt_tokens=500.0, output_tokens=100.0,
                         max_batch=4)


def test_the_profile_interpolates_the_batch_within_a_tpot():
    assert PROFILE.batch_within(0.014) == pytest.approx(3.0)  # halfway from 2 to 4
    assert PROFILE.batch_within(0.005) == 1.0  # even one misses it
    assert PROFILE.batch_within(1.0) == 4.0  # the largest profiled (and max_batch)
    tokens = 3.0 / 0.014
    assert PROFILE.requests_per_s(0.014) == pytest.approx(tokens / (100 + 500 * 1e-4 * tokens))


class _ReadsDescriptor(SimEngine):
    """An engine that (wrongly) reads the padded descriptor of the steps it prices."""

    def step_packed(self, packed):
        packed.inputs
        return super().step_packed(packed)


def test_the_profile_prices_steps_on_the_simulator_and_an_engine_reading_a_descriptor_is_a_bug():
    requests = [Request(id=i, arrival_s=0.0, prompt_len=40, output_len=20) for i in range(4)]
    profile = profile_replica(Scheduler(requests, policies.make_policy("vllm"), _engine(), CONFIG))
    # fixed steps: every priced decode step takes STEP_S; the prefill its share of one
    np.testing.assert_allclose(profile.decode_step_s, STEP_S)
    assert profile.prompt_tokens == 40.0 and profile.output_tokens == 20.0
    engine = _ReadsDescriptor(CostModelConfig(mode="fixed", model="tiny", step_time_s=STEP_S))
    with pytest.raises(ProfileDescriptorError) as raised:
        profile_replica(Scheduler(requests, policies.make_policy("vllm"), engine, CONFIG))
    assert str(raised.value).startswith("bug: the engine asked the planner's profile for a "
                                        "built step descriptor") and "\n" not in str(raised.value)


def _metrics(**fields):
    base = dict(now_s=10.0, interval_s=1.0, num_replicas=2, num_ready=2, num_starting=0,
                num_draining=0, min_replicas=1, max_replicas=8, startup_s=1.0,
                outstanding=np.array([3, 5]), waiting=np.array([0, 1]),
                kv_usage=np.array([0.2, 0.4]), arrival_rates=np.array([1.0, 2.0, 3.0]),
                slo_attainment=None, ttft_slo_s=None, tpot_slo_s=0.014, profile=PROFILE)
    return PlannerMetrics(**{**base, **fields})


def test_the_sla_planner_forecasts_and_divides_by_the_profile():
    per_replica = PROFILE.requests_per_s(0.014)
    trend = policies.planners.SlaPlanner(headroom=1.0)
    # Rates 1, 2, 3: the trend one start-up plus one interval (2 intervals) ahead is 5.
    assert trend.forecast(_metrics()) == pytest.approx(5.0)
    assert trend.plan(_metrics()) == math.ceil(5.0 / per_replica)
    average = policies.planners.SlaPlanner(predictor="moving_average", headroom=1.0)
    assert average.forecast(_metrics()) == pytest.approx(2.0)
    # A missed SLO adds one replica over what is there.
    assert trend.plan(_metrics(slo_attainment=0.5, num_replicas=7)) == 8
    assert trend.plan(_metrics(arrival_rates=np.array([100.0]))) == 8  # the cap


def test_the_threshold_planner_steps_and_waits_for_starting_replicas():
    planner = policies.planners.Threshold(scale_up_load=3.0, scale_down_load=1.0)
    assert planner.plan(_metrics()) == 3  # 4 outstanding a replica > 3
    assert planner.plan(_metrics(num_starting=1, num_replicas=3)) == 3
    assert planner.plan(_metrics(outstanding=np.array([1, 0]))) == 1
    assert planner.plan(_metrics(outstanding=np.array([1, 0]), min_replicas=2)) == 2


def test_replica_seconds_integrates_the_step_function():
    timeline = [{"time_s": 0.0, "replicas": 2}, {"time_s": 3.0, "replicas": 5},
                {"time_s": 4.0, "replicas": 1}]
    assert replica_seconds(timeline, 10.0) == 2 * 3 + 5 * 1 + 1 * 6
    assert replica_seconds(timeline, 3.5) == 2 * 3 + 5 * 0.5


def test_repeat_trace_shifts_each_copy_by_a_period():
    trace = [Request(id=7, arrival_s=t, prompt_len=10, output_len=5, deadline_s=t + 1)
             for t in (0.0, 1.0, 3.0)]
    out = repeat_trace(trace, 3)
    # Period: the last arrival (3) plus the mean gap (1.5).
    np.testing.assert_allclose([r.arrival_s for r in out],
                               [0, 1, 3, 4.5, 5.5, 7.5, 9, 10, 12])
    assert [r.id for r in out] == list(range(9))
    assert out[4].deadline_s == pytest.approx(6.5)
    with pytest.raises(ValueError, match="trace_repeat must be an integer >= 1"):
        repeat_trace(trace, 0)


def test_run_cli_writes_the_replica_timeline(tmp_path):
    from cli_runner import run_module

    out = tmp_path / "run"
    run_module("experiments.run", "--engine=sim", "--model=tiny", "--step_time_ms=10",
               "--num_requests=150", "--rate=40", "--num_replicas=1", "--max_replicas=3",
               "--policy=vllm", "--planner=threshold",
               "--planner_opts=scale_up_load=2,scale_down_load=1",
               "--planner_interval_s=0.5", "--replica_startup_s=0.2",
               "--ttft_slo_s=1", f"--out_dir={out}")
    rows = [json.loads(line) for line in (out / "replicas.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["planner"] == "threshold" and summary["num_finished"] == 150
    assert summary["replicas_max"] > 1 and summary["num_replica_starts"] >= 1
    end_s = json.loads((out / "status.json").read_text())["virtual_time_s"]
    assert summary["replica_seconds"] == pytest.approx(replica_seconds(rows, end_s))
    assert summary["goodput_per_replica_s"] == pytest.approx(
        round(summary["slo_attainment"] * 150) / summary["replica_seconds"])


@pytest.mark.parametrize("flags, message", [
    (("--num_replicas=2", "--max_replicas=4"),
     "error: cluster: max_replicas=4 set without a planner; give planner=NAME"),
    (("--planner=threshold",),
     "error: cluster: planner 'threshold' has nothing to scale with max_replicas=1"),
    (("--num_replicas=1", "--planner=threshold", "--max_replicas=4", "--min_replicas=2"),
     "error: cluster: planner 'threshold': num_replicas=1 (the replicas at the start) must "
     "lie within min_replicas=2 and max_replicas=4"),
    (("--planner=nope", "--max_replicas=2"), "error: unknown planner 'nope'"),
    (("--planner=sla", "--max_replicas=2", "--planner_opts=window=0"),
     "error: planner 'sla': window must be >= 1, got 0"),
    (("--trace_repeat=2",),
     "error: --trace_repeat: workload.trace_repeat=2 repeats a trace; arrival is 'poisson', "
     "not 'trace'"),
    (("--planner=sla", "--max_replicas=2", "--prefill_replicas=1", "--decode_replicas=1"),
     "error: cluster: planner 'sla' scales colocated replicas without a rebalancer; got "
     "prefill/decode pools"),
])
def test_bad_planner_flags_are_one_line_and_nothing_runs(tmp_path, flags, message):
    from cli_runner import run_module

    out = tmp_path / "run"
    result = run_module("experiments.run", "--engine=sim", "--num_requests=5", *flags,
                        f"--out_dir={out}", check=False)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(message)
    assert not out.exists()


def test_the_day_experiment_runs_every_setup_on_the_same_requests(tmp_path, capsys):
    from experiments import planners_day

    trace = tmp_path / "trace.csv"
    rng = np.random.default_rng(0)
    times = np.sort(rng.uniform(0, 120, 60))
    trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n" + "".join(
        f"{t:.3f},{int(rng.integers(50, 400))},{int(rng.integers(1, 60))}\n" for t in times))
    out = tmp_path / "day"
    planners_day.main([f"--trace={trace}", "--repeat=2", "--time_scale=1", "--interval_s=20",
                       f"--out_dir={out}"])
    rows = json.loads((out / "planners_day.json").read_text())["rows"]
    assert [r["setup"] for r in rows] == ["static", "threshold", "sla"]
    assert {r["requests"] for r in rows} == {120} and {r["finished"] for r in rows} == {120}
    static = rows[0]
    assert static["replica_hours"] == pytest.approx(8 * static["day_h"])
    for row in rows[1:]:  # from 8 replicas, planners only shed load this light
        assert row["replica_hours"] < static["replica_hours"]
        assert row["planner_calls"] >= 1
    printed = capsys.readouterr().out
    assert "x the static cluster's replica-hours" in printed
