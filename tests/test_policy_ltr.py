"""The `ltr` policy: SJF/SRPT by a trained ranker, through the Scheduler on a fixed-step sim."""

import numpy as np
import pytest

import policies  # noqa: F401  (registers the built-in policies)
from orca_jax import (
    KVConfig,
    Request,
    RequestState,
    Scheduler,
    SchedulerConfig,
    StepLimits,
    make_policy,
)
from orca_jax.core.api.policy import PolicyLoadError
from orca_jax.learned.ranker import Ranker, RankerConfig, synthetic_ranking_workload, train_ranker
from orca_jax.sim.cost_model import CostModelConfig
from orca_jax.sim.engine import SimEngine


@pytest.fixture(scope="module")
def ranker_dir(tmp_path_factory):
    """A ranker trained on 800 synthetic requests, saved; the workload's seed differs below."""
    directory = tmp_path_factory.mktemp("ltr") / "ranker"
    train_ranker(synthetic_ranking_workload(800, seed=3), RankerConfig(num_steps=150)).save(
        str(directory))
    return str(directory)


@pytest.fixture(scope="module")
def burst():
    """200 held-out requests, all arriving at t=0."""
    return synthetic_ranking_workload(200, seed=11)


def run(requests, policy, options=None, *, cap=16, num_kv_pages=2048):
    scheduler = Scheduler(requests, make_policy(policy, options),
                          SimEngine(CostModelConfig(mode="fixed", step_time_s=1.0)),
                          SchedulerConfig(limits=StepLimits(max_num_seqs=cap, max_num_tokens=512,
                                                            max_model_len=1024),
                                          kv=KVConfig(num_kv_pages=num_kv_pages, page_size=16)))
    scheduler.run()
    table = scheduler.table
    assert (table.state == RequestState.FINISHED).all()
    np.testing.assert_array_equal(table.num_generated, table.output_len)  # nothing lost
    owners, _ = scheduler.record.token_log()
    np.testing.assert_array_equal(np.bincount(owners, minlength=len(requests)), table.output_len)
    return scheduler


@pytest.mark.parametrize("preemptive", [False, True])
def test_ltr_serves_short_jobs_first_and_beats_fcfs(ranker_dir, burst, preemptive):
    options = {"ranker_dir": ranker_dir, "preemptive": str(preemptive)}
    latency = {}
    tables = {}
    for name, opts in [("orca", None), ("vllm", None), ("ltr", options),
                       ("sjf", {"prompt_token_weight": "0"})]:  # sjf: oracle lengths
        tables[name] = run(burst, name, opts).table
        latency[name] = float(np.mean(tables[name].finish_s - tables[name].arrival_s))
    # Measured: orca 801, vllm 801, ltr 418 (either way), oracle sjf 383 steps.
    assert latency["ltr"] < 0.7 * min(latency["orca"], latency["vllm"]), latency
    assert latency["ltr"] >= latency["sjf"] - 1e-9  # the oracle is the bound
    output_len = tables["ltr"].output_len
    short = output_len <= np.quantile(output_len, 0.25)
    assert tables["ltr"].finish_s[short].mean() < 0.1 * tables["orca"].finish_s[short].mean()


def test_ltr_predicts_once_per_request_at_construction_time(ranker_dir, burst, monkeypatch):
    seen = []
    original = Ranker.predict_output_len

    def counting(self, requests):
        seen.extend(r.id for r in requests)
        return original(self, requests)

    restored = []
    original_restore = Ranker.restore.__func__

    def counting_restore(cls, directory):
        restored.append(directory)
        return original_restore(cls, directory)

    monkeypatch.setattr(Ranker, "predict_output_len", counting)
    monkeypatch.setattr(Ranker, "restore", classmethod(counting_restore))
    policy = make_policy("ltr", {"ranker_dir": ranker_dir, "preemptive": "true"})
    assert restored == [ranker_dir]  # loaded when the policy is built, not per step
    scheduler = Scheduler(burst[:40], policy,
                          SimEngine(CostModelConfig(mode="fixed", step_time_s=1.0)),
                          SchedulerConfig(limits=StepLimits(max_num_seqs=4, max_num_tokens=256,
                                                            max_model_len=1024),
                                          kv=KVConfig(num_kv_pages=512, page_size=16)))
    scheduler.run()
    assert sorted(seen) == list(range(40)) and restored == [ranker_dir]


def test_starvation_guard_promotes_a_long_request(ranker_dir):
    pool = synthetic_ranking_workload(300, seed=21)
    scores = Ranker.restore(ranker_dir).scores(pool)
    long_one = pool[int(np.argmax(scores))]
    shorts = [pool[int(i)] for i in np.argsort(scores)[:10]]
    # One short job arrives every step from t=0: the queue of shorter jobs never empties.
    requests = [Request(id=0, arrival_s=0.0, prompt_len=long_one.prompt_len, output_len=50,
                        prompt_tokens=long_one.prompt_tokens)]
    requests += [Request(id=1 + i, arrival_s=float(i), prompt_len=r.prompt_len,
                         output_len=r.output_len, prompt_tokens=r.prompt_tokens)
                 for i, r in enumerate(shorts)]
    base = {"ranker_dir": ranker_dir}
    starved = run(requests, "ltr", base, cap=1).table
    assert starved.first_scheduled_s[0] == starved.finish_s[1:].max()  # after every short one
    guarded = run(requests, "ltr", {**base, "starvation_s": "3"}, cap=1).table
    # Overdue from t=3; non-preemptive, it starts when the running short job finishes.
    running_at_3 = (guarded.first_scheduled_s[1:] <= 3) & (guarded.finish_s[1:] > 3)
    assert guarded.first_scheduled_s[0] == guarded.finish_s[1:][running_at_3].item()
    assert guarded.first_scheduled_s[0] < starved.first_scheduled_s[0]


def test_ltr_loses_nothing_under_kv_pressure(ranker_dir):
    requests = synthetic_ranking_workload(40, seed=8, max_prompt_len=64, max_output_len=64,
                                          arrival_rate=4.0)
    for preemptive in ("false", "true"):
        scheduler = run(requests, "ltr", {"ranker_dir": ranker_dir, "preemptive": preemptive},
                        cap=8, num_kv_pages=12)
        assert scheduler.record.num_preemptions > 0


@pytest.mark.parametrize("options, words", [
    ({}, ["'ltr'", "ranker_dir", "train_ranker"]),
    ({"ranker_dir": "/no/such/ranker"}, ["ranker_dir", "/no/such/ranker", "ranker.json"]),
    ({"ranker_dir": "x", "preemptive": "sometimes"}, ["preemptive", "sometimes"]),
])
def test_bad_options_say_what_is_wrong(options, words):
    with pytest.raises(PolicyLoadError) as raised:
        make_policy("ltr", options)
    for word in words:
        assert word in str(raised.value), str(raised.value)


def test_a_saved_ranker_is_a_predictor_for_any_ranking_policy(ranker_dir, burst):
    # `ltr:DIR` resolves without importing orca_jax.learned.ranker first: srpt ranks by it.
    learned = run(burst, "srpt", {"predictor": f"ltr:{ranker_dir}"}).table
    fcfs = run(burst, "orca").table
    assert np.mean(learned.finish_s - learned.arrival_s) < 0.7 * np.mean(
        fcfs.finish_s - fcfs.arrival_s)
