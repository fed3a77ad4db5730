"""Overlap scheduling: with it on, the same plans, steps and tokens as with it off.

A numpy engine that feeds tokens as the jax engine does (the previous step's
sampled tokens kept "on the device", decodes' inputs taken from them by
`token_source`) and samples a token that depends on every input token, so a
token fed from the wrong row, or a placeholder left in place, changes the
output. Then the real jax engine, through the command line.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from orca_jax import KVConfig, LoopFeatures, Scheduler, SchedulerConfig, StepLimits
from orca_jax.core.api.policy import make_policy
from orca_jax.core.step.engine_api import Engine, PendingStep, StepInputs, StepOutput
from orca_jax.workloads.synthetic import synthetic_workload

REPO = Path(__file__).resolve().parents[1]
VOCAB = 1000


class _Pending(PendingStep):
    def __init__(self, engine, inputs, token_ids):
        self._engine, self._inputs, self._token_ids = engine, inputs, token_ids
        self._tokens = None

    @property
    def step_s(self):
        return 1e-3 * (1 + self._inputs.num_real_tokens)  # a price of the descriptor

    def output(self):
        if self._tokens is None:  # "waits for the device"
            self._engine.num_waits += 1
            self._tokens = self._engine.sample(self._inputs, self._token_ids)
        return StepOutput(sampled_tokens=self._tokens, step_s=self.step_s)


class FeedingEngine(Engine):
    """Samples hash(every query token id, its position) per sequence; feeds tokens."""

    def __init__(self, feed: bool):
        self._feed, self._last, self.num_waits, self.num_fed = feed, None, 0, 0

    name = "fake"
    needs_token_ids = True

    @property
    def feeds_tokens(self):
        return self._feed

    def _prepare(self, buckets):
        pass

    def step(self, inputs):
        return self.step_async(inputs).output()

    def step_async(self, inputs: StepInputs, token_source=None):
        token_ids = inputs.token_ids.copy()
        if token_source is not None:
            assert self._feed and token_source.shape == token_ids.shape
            fed = token_source >= 0
            token_ids[fed] = self._last.output().sampled_tokens[token_source[fed]]
            self.num_fed += int(fed.sum())
        self._last = _Pending(self, inputs, token_ids)
        return self._last

    @staticmethod
    def sample(inputs, token_ids):
        s = inputs.bucket.num_seqs
        mixed = (token_ids.astype(np.int64) * 7919 + inputs.positions * 31) % VOCAB
        sums = np.add.reduceat(mixed, np.minimum(inputs.cu_q_lens[:-1], len(mixed) - 1))
        tokens = ((sums + inputs.kv_lens) % (VOCAB - 1) + 1).astype(np.int32)
        tokens[inputs.num_real_seqs:] = 0
        return tokens[:s]


def _run(policy, options, overlap, **kv):
    requests = synthetic_workload(num_requests=24, arrival="poisson", rate=200.0,
                                  prompt_len="uniform:4:60", output_len="uniform:1:30", seed=3,
                                  vocab_size=VOCAB)
    config = SchedulerConfig(limits=StepLimits(max_num_seqs=6, max_num_tokens=64,
                                               max_model_len=128),
                             kv=KVConfig(page_size=8, **kv),
                             features=LoopFeatures(log_step_requests=True, overlap=overlap))
    engine = FeedingEngine(feed=overlap)
    scheduler = Scheduler(requests, make_policy(policy, options), engine, config)
    result = scheduler.run()
    return result, engine, scheduler


@pytest.mark.parametrize("policy,options,limits", [
    ("orca", {}, {}),
    ("sarathi", {"max_num_tokens": "32"}, {}),  # chunked prefills beside decodes
    ("vllm", {"enable_prefix_caching": "false"}, {"num_kv_pages": 24}),  # preempts, recomputes
])
def test_overlap_gives_the_same_plans_steps_and_tokens(policy, options, limits):
    off, _, _ = _run(policy, options, False, **limits)
    on, engine, scheduler = _run(policy, options, True, **limits)
    assert scheduler.executor.depth == 2
    assert engine.num_fed > 50  # decodes really took their input from the previous step
    assert [list(t) for t in on.output_tokens] == [list(t) for t in off.output_tokens]
    assert sum(map(len, on.output_tokens)) > 200
    assert len(on.step_requests) == len(off.step_requests) > 20
    for a, b, ta, tb in zip(on.step_requests, off.step_requests, on.step_tokens,
                            off.step_tokens):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(ta, tb)
    np.testing.assert_array_equal(on.finish_s, off.finish_s)
    if limits:
        np.testing.assert_array_equal(on.num_preemptions, off.num_preemptions)
        assert on.num_preemptions.sum() > 0


def test_overlap_reads_each_step_back_once_and_one_step_late():
    result, engine, scheduler = _run("orca", {}, True)
    assert engine.num_waits == len(result.step_requests)  # every step once, none twice
    assert scheduler.executor.num_in_flight == 0  # the last one landed before the result


def test_without_a_feeding_engine_or_with_prefix_caching_overlap_runs_in_step():
    requests = synthetic_workload(num_requests=4, arrival="burst", rate=None,
                                  prompt_len="fixed:8", output_len="fixed:4", seed=0,
                                  vocab_size=VOCAB)
    config = SchedulerConfig(limits=StepLimits(max_num_seqs=4, max_num_tokens=32, max_model_len=64),
                             kv=KVConfig(page_size=8),
                             features=LoopFeatures(overlap=True))
    assert Scheduler(requests, make_policy("orca"), FeedingEngine(False),
                     config).executor.depth == 1
    caching = Scheduler(requests, make_policy("vllm"), FeedingEngine(True), config)
    assert caching.prefix_caching and caching.executor.depth == 1


def test_an_engine_that_does_not_feed_refuses_a_token_source():
    with pytest.raises(ValueError, match="FeedingEngine.step_async: this engine does not feed"):
        Engine.step_async(FeedingEngine(False), None, np.zeros(4, np.int32))


def test_jax_engine_feeds_the_previous_step_tokens_by_row():
    from orca_jax.core.step.engine_api import Bucket
    from orca_jax.core.step.packing import build_step_inputs
    from orca_jax.model import weights
    from orca_jax.model.engine import JaxEngine
    from orca_jax.specs.model_config import get_model_config

    tiny, bucket = get_model_config("tiny"), Bucket(16, 4)
    pages = np.array([[1, 2, 0, 0], [3, 4, 0, 0]], np.int32)

    def engine(feed):
        built = JaxEngine(tiny, weights.init_params(tiny, seed=0), num_cache_pages=8,
                          page_size=4, pages_per_seq=4, feed_tokens=feed)
        built.warmup([bucket])
        return built

    def inputs(num_tokens, num_computed, rows, token_ids):
        return build_step_inputs(bucket, num_tokens=np.array(num_tokens),
                                 num_computed=np.array(num_computed), page_rows=pages[rows],
                                 page_size=4, token_ids=np.array(token_ids, np.int32))

    prefill = inputs([3, 2], [0, 0], [0, 1], [5, 6, 7, 9, 10])
    plain, fed = engine(False), engine(True)
    first = plain.step(prefill).sampled_tokens
    pending = fed.step_async(prefill)
    # The second step decodes the sequences in the other order, with their new tokens
    # known to the plain engine's host and only "on the device" to the feeding one.
    second = plain.step(inputs([1, 1], [2, 3], [1, 0], [first[1], first[0]])).sampled_tokens
    source = np.full(16, -1, np.int32)
    source[:2] = [1, 0]
    fed_second = fed.step_async(inputs([1, 1], [2, 3], [1, 0], [0, 0]), source)
    np.testing.assert_array_equal(pending.output().sampled_tokens[:2], first[:2])
    np.testing.assert_array_equal(fed_second.output().sampled_tokens[:2], second[:2])
    assert fed.num_compiles == plain.num_compiles == 1  # one bucket, each way
    with pytest.raises(ValueError, match="token_source needs feed_tokens=True"):
        plain.step_async(prefill, source)
    with pytest.raises(ValueError, match=r"token_source has shape \(3,\)"):
        fed.step_async(prefill, source[:3])


def _cli(out_dir, *flags):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, "-m", "experiments.run", "--engine=jax", "--model=tiny",
         "--policy=sarathi", "--policy_opts=max_num_tokens=32", "--num_requests=12",
         "--rate=50", "--prompt_len=uniform:4:40", "--output_len=uniform:1:24",
         "--max_num_seqs=4", "--max_num_tokens=64", "--buckets=16,64", "--log_step_requests",
         f"--out_dir={out_dir}", *flags],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_jax_engine_overlap_on_and_off_give_the_same_run(tmp_path):
    table = tmp_path / "profile.json"  # one profiled clock for both runs
    runs = {}
    for name, flag in (("on", "--overlap"), ("off", "--nooverlap")):
        result = _cli(tmp_path / name, flag, f"--profile_table={table}")
        assert result.returncode == 0, result.stderr[-3000:]
        rows = [json.loads(line) for line in
                (tmp_path / name / "requests.jsonl").read_text().splitlines()]
        steps = [json.loads(line) for line in
                 (tmp_path / name / "steps.jsonl").read_text().splitlines()]
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        runs[name] = rows, steps, summary
    (rows_on, steps_on, on), (rows_off, steps_off, off) = runs["on"], runs["off"]
    assert [r["output_tokens"] for r in rows_on] == [r["output_tokens"] for r in rows_off]
    assert sum(len(r["output_tokens"]) for r in rows_on) > 100
    assert len(steps_on) == len(steps_off) > 20
    for a, b in zip(steps_on, steps_off):
        assert a["host_s"] > 0 and a["step_s"] > 0  # both times kept with overlap on
        for key in a:
            if key != "host_s":  # measured host time differs; the rest is the same run
                assert a[key] == b[key], (key, a, b)
    assert on["num_compiles"] == off["num_compiles"] == 2  # exactly the buckets, each way
