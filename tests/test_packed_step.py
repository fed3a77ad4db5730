"""Packed steps: the simulator prices a step from its lengths, never building its padded
descriptor, and gives exactly what `step` gives on the descriptor `pack_step` builds."""

import time

import numpy as np
import pytest

import policies
from orca_jax import KVConfig, Request, Scheduler, SchedulerConfig, StepLimits, StepOutput
from orca_jax.core.step import packing
from orca_jax.core.step.engine_api import Bucket, Engine
from orca_jax.core.step.packing import SamplingArrays, bucket_config_for, pack_step
from orca_jax.sim.cost_model import CostModelConfig, LinearStepTime
from orca_jax.sim.engine import SimEngine

CONFIGS = {
    "per_op": CostModelConfig(),
    "roofline_max": CostModelConfig(mode="roofline_max"),
    "fixed": CostModelConfig(mode="fixed", step_time_s=0.004),
    "fitted": CostModelConfig(mode="fitted", fitted_step_s={
        16: 0.002, 32: LinearStepTime(
        base_s=1e-3, per_seq_s=1e-6, per_tile_s=2e-9, q_tile=16, kv_tile=16), 64: 0.005}),
}


def _packed(q_lens, computed, rows_width=8):
    q = np.asarray(q_lens, np.int64)
    computed = np.asarray(computed, np.int64)
    n = q.size
    config = bucket_config_for(max_num_tokens=64, max_num_seqs=8, max_model_len=128,
                               page_size=8)
    sampling = SamplingArrays(temperature=np.zeros(n, np.float32), top_k=np.zeros(n, np.int32),
                              top_p=np.ones(n, np.float32), rng_seeds=np.zeros(n, np.uint32))
    page_rows = (np.arange(n * rows_width, dtype=np.int32).reshape(n, rows_width) + 1)
    args = dict(bucket_config=config, request_ids=np.arange(n), num_tokens=q,
                num_computed=computed, page_rows=page_rows, page_size=8, sampling=sampling)
    return pack_step(**args), pack_step(**args).inputs  # the second built at once


@pytest.mark.parametrize("mode", sorted(CONFIGS))
@pytest.mark.parametrize("q_lens, computed", [
    ([1, 1, 1], [5, 17, 40]),  # decodes only
    ([9, 1, 3], [0, 30, 8]),  # a prefill, a decode, a chunk
    ([20], [0]),  # one prompt
])
def test_a_packed_step_is_priced_and_sampled_as_its_descriptor(mode, q_lens, computed):
    packed, inputs = _packed(q_lens, computed)
    warm, cold = SimEngine(CONFIGS[mode]), SimEngine(CONFIGS[mode])
    warm.warmup([packed.bucket])
    by_lengths = warm.step_packed(packed)
    by_descriptor = cold.step(inputs)
    assert by_lengths.step_s == by_descriptor.step_s  # bit for bit
    np.testing.assert_array_equal(by_lengths.sampled_tokens, by_descriptor.sampled_tokens)
    assert by_lengths.sampled_tokens.dtype == np.int32
    assert packed.bucket == inputs.bucket and packed._inputs is None  # never built


def test_the_descriptor_is_built_once_on_first_read_and_equals_pack_s():
    packed, inputs = _packed([9, 1, 3], [0, 30, 8])
    assert packed.build_s == 0.0
    first = packed.inputs
    assert packed.build_s > 0.0  # host work the scheduler counts
    assert packed.inputs is first
    for name in ("token_ids", "positions", "cu_q_lens", "kv_lens", "page_indices",
                 "slot_mapping", "sample_indices", "num_seqs", "top_p"):
        np.testing.assert_array_equal(getattr(first, name), getattr(inputs, name))
    np.testing.assert_array_equal(packed.q_lens, [9, 1, 3])
    np.testing.assert_array_equal(packed.kv_lens, [9, 31, 11])


def test_a_cold_bucket_is_refused_by_a_packed_step_too():
    packed, _ = _packed([1, 1], [3, 4])
    engine = SimEngine(CONFIGS["fixed"])
    engine.warmup([Bucket(64, 8)])
    with pytest.raises(ValueError, match="was not warmed up"):
        engine.step_packed(packed)


class _CountingEngine(Engine):
    """An Engine with only `step`: the default `step_packed` hands it the descriptor."""

    name = "counting"
    needs_token_ids = False

    def __init__(self):
        self.seen = []

    def _prepare(self, buckets):
        del buckets

    def step(self, inputs):
        self.seen.append(inputs)
        return StepOutput(sampled_tokens=np.zeros(inputs.bucket.num_seqs, np.int32),
                          step_s=0.01)


def test_an_engine_reading_descriptors_gets_every_step_s_and_the_sim_none(monkeypatch):
    requests = [Request(id=i, arrival_s=0.0, prompt_len=10 + 3 * i, output_len=4)
                for i in range(3)]
    config = SchedulerConfig(limits=StepLimits(max_num_seqs=4, max_num_tokens=64, max_model_len=64),
                             kv=KVConfig(num_kv_pages=32, page_size=8))
    packed_steps = []

    class Keeping(_CountingEngine):
        def step_packed(self, packed):
            packed_steps.append(packed)
            return super().step_packed(packed)

    real_build = packing.build_step_inputs

    def slow_build(*args, **kwargs):  # a build far longer than the rest of an iteration
        time.sleep(0.02)
        return real_build(*args, **kwargs)

    monkeypatch.setattr(packing, "build_step_inputs", slow_build)
    counting = Keeping()
    result = Scheduler(requests, policies.make_policy("vllm", {}), counting, config).run()
    assert len(counting.seen) == result.num_steps
    # Building the descriptor inside the engine's call is still the step's host time.
    assert all(p.build_s >= 0.02 and step.host_s >= p.build_s
               for p, step in zip(packed_steps, result.steps))
    monkeypatch.undo()
    assert [int(s.cu_q_lens[int(s.num_seqs[0])]) for s in counting.seen] == [
        step.num_tokens for step in result.steps]

    built = []

    class Spy(SimEngine):
        def step_packed(self, packed):
            built.append(packed)
            return super().step_packed(packed)

    sim = Spy(CostModelConfig(mode="fixed", step_time_s=0.01))
    Scheduler(requests, policies.make_policy("vllm", {}), sim, config).run()
    assert len(built) == result.num_steps
    assert all(p._inputs is None for p in built)  # no descriptor was built
