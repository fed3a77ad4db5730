"""The KV seams hold: a host tier and a swap preemption mode, written as plugins under
`tests/kv_toys/`, run a KV-tight workload to completion with no token lost or computed
twice, and the default run (the device tier alone, `recompute`) is as before."""

import dataclasses

import numpy as np
import pytest
from kv_toys.host_tier import HostTier, Swap

import policies
from orca_jax import (
    KVConfig,
    Request,
    RequestState,
    Scheduler,
    SchedulerConfig,
    StepLimits,
    StepOutput,
)
from orca_jax.core.kv import preemption_modes, register_preemption_mode, unregister_preemption_mode
from orca_jax.sim.cost_model import CostModelConfig
from orca_jax.sim.engine import SimEngine
from policies.vllm import VLLM

PAGE = 4
STEP_S = 0.01
CONFIG = SchedulerConfig(limits=StepLimits(max_num_seqs=6, max_num_tokens=32, max_model_len=64),
                         kv=KVConfig(num_kv_pages=14, page_size=PAGE, prefix_caching="off"))


class ContentEngine:
    """Writes each token's id into its KV slot and samples, for each sequence, a token
    computed from every slot of its context: a lost or stale KV page changes the answer."""

    name = "kv_content"
    needs_token_ids = True
    feeds_tokens = False

    def __init__(self, num_pages: int) -> None:
        self.kv = np.zeros((num_pages + 1, PAGE), dtype=np.int64)  # [pages + 1, page] ids

    def warmup(self, buckets) -> None:
        del buckets

    def step(self, inputs) -> StepOutput:
        real = inputs.num_real_tokens
        self.kv.reshape(-1)[inputs.slot_mapping[:real]] = inputs.token_ids[:real]
        sampled = np.zeros(inputs.kv_lens.size, dtype=np.int32)
        for s in range(inputs.num_real_seqs):
            length = int(inputs.kv_lens[s])
            context = self.kv[inputs.page_indices[s]].reshape(-1)[:length]
            sampled[s] = int((context * np.arange(1, length + 1)).sum() % 997) + 1
        return StepOutput(sampled_tokens=sampled, step_s=STEP_S)

    def read_kv_pages(self, pages):
        return self.kv[pages].copy()

    def write_kv_pages(self, pages, kv) -> None:
        self.kv[pages] = kv


@dataclasses.dataclass(kw_only=True)
class SwappingVLLM(VLLM):
    """`vllm`, whose victims swap instead of recomputing."""

    def preemption_modes(self, view, victims):
        return "toy_swap"


@pytest.fixture
def swap_mode():
    register_preemption_mode("toy_swap", Swap())
    yield
    unregister_preemption_mode("toy_swap")


def workload(seed=0, num_requests=10):
    rng = np.random.default_rng(seed)
    return [Request(id=i, arrival_s=0.0, prompt_len=int(p), output_len=int(o),
                    prompt_tokens=rng.integers(1, 500, size=int(p), dtype=np.int32))
            for i, (p, o) in enumerate(zip(rng.integers(4, 20, num_requests),
                                           rng.integers(6, 30, num_requests)))]


def run(policy, engine, config=CONFIG, tier=None):
    scheduler = Scheduler(workload(), policy, engine, config)
    if tier is not None:
        scheduler.kv_memory.tiers.add(tier)
    result = scheduler.run()
    table = scheduler.table
    assert (table.state == RequestState.FINISHED).all()
    np.testing.assert_array_equal(table.num_generated, table.output_len)
    scheduler.kv.check_consistency()
    assert scheduler.kv.num_free == config.kv.num_kv_pages  # every page came back
    return scheduler, result


def computed_tokens(scheduler) -> int:
    return sum(step.num_tokens for step in scheduler.record.steps)


def test_swap_keeps_every_token_and_computes_none_twice(swap_mode):
    roomy = CONFIG.with_knobs(num_kv_pages=400)
    reference, expected = run(policies.make_policy("vllm"), ContentEngine(400), roomy)
    assert reference.record.num_preemptions == 0
    recompute, recomputed = run(policies.make_policy("vllm"), ContentEngine(CONFIG.kv.num_kv_pages))
    engine = ContentEngine(CONFIG.kv.num_kv_pages)
    host = HostTier(capacity_pages=1000, delay_s=0.5, engine=engine)
    swap, swapped = run(SwappingVLLM(), engine, tier=host)

    assert recompute.record.num_preemptions > 0 and swap.record.num_preemptions > 0
    assert host.num_moves == 2 * swap.record.num_preemptions  # each out, then back in
    table = swap.table
    # Every token is computed once: prompt and answer, less the last answer token.
    assert computed_tokens(swap) == int((table.prompt_len + table.output_len - 1).sum())
    assert computed_tokens(recompute) > computed_tokens(swap)  # recompute did work twice
    for got in (recomputed, swapped):  # the same tokens as with room for everyone
        assert all(np.array_equal(a, b) for a, b in zip(got.output_tokens, expected.output_tokens))
    assert swap.kv_memory.tiers.num_used(1) == 0  # nothing left on the host


def test_a_tier_that_loses_the_kv_changes_the_answers(swap_mode):
    roomy = CONFIG.with_knobs(num_kv_pages=400)
    _, expected = run(policies.make_policy("vllm"), ContentEngine(400), roomy)
    engine = ContentEngine(CONFIG.kv.num_kv_pages)
    _, lost = run(SwappingVLLM(), engine, tier=HostTier(1000, 0.0, engine=engine, lossy=True))
    assert not all(np.array_equal(a, b) for a, b in zip(lost.output_tokens,
                                                         expected.output_tokens))


def test_each_swap_is_priced_as_the_tier_s_fixed_delay(swap_mode):
    # On the simulator, with everyone arriving at once, the plans do not depend on the clock:
    # the delay moves the end by exactly one delay per move.
    def sim():
        return SimEngine(CostModelConfig(mode="fixed", model="tiny", step_time_s=STEP_S))
    free, _ = run(SwappingVLLM(), sim(), tier=HostTier(1000, 0.0))
    host = HostTier(1000, 0.25)
    priced, _ = run(SwappingVLLM(), sim(), tier=host)
    assert host.num_moves > 0 and priced.num_steps == free.num_steps
    assert priced.now_s == pytest.approx(free.now_s + 0.25 * host.num_moves)


def test_recompute_and_swap_are_the_built_in_modes_and_unknown_modes_are_named():
    assert preemption_modes() == ["recompute", "swap"]

    @dataclasses.dataclass(kw_only=True)
    class Unknown(VLLM):
        def preemption_modes(self, view, victims):
            return "teleport"

    with pytest.raises(ValueError, match="preemption mode 'teleport' is not one of"):
        run(Unknown(), ContentEngine(CONFIG.kv.num_kv_pages))


@dataclasses.dataclass(kw_only=True)
class HalfSwappingVLLM(VLLM):
    """`vllm` choosing per victim: even request indices swap, odd ones recompute."""

    def preemption_modes(self, view, victims):
        return ["toy_swap" if victim % 2 == 0 else "recompute" for victim in victims.tolist()]


def test_modes_chosen_per_victim_keep_every_token(swap_mode):
    roomy = CONFIG.with_knobs(num_kv_pages=400)
    _, expected = run(policies.make_policy("vllm"), ContentEngine(400), roomy)
    engine = ContentEngine(CONFIG.kv.num_kv_pages)
    host = HostTier(capacity_pages=1000, delay_s=0.0, engine=engine)
    mixed, got = run(HalfSwappingVLLM(), engine, tier=host)
    preempted = mixed.table.num_preemptions > 0
    assert preempted[0::2].any() and preempted[1::2].any()  # both modes were used
    assert host.num_moves == 2 * int(mixed.table.num_preemptions[0::2].sum())  # only evens moved
    assert all(np.array_equal(a, b) for a, b in zip(got.output_tokens, expected.output_tokens))
