"""`SchedulerView.preemption_costs`: what swap and recompute would cost each victim, read by
a policy that chooses per victim (issue 27)."""

import dataclasses

import numpy as np

from orca_jax.core.loop.scheduler import Scheduler
from orca_jax.core.requests.request import RequestState
from orca_jax.runner.build import build_engine, build_workload, scheduler_config
from orca_jax.runner.spec import LimitsSpec, RunSpec, SimEngineSpec, WorkloadSpec
from orca_jax.specs.hardware import get_kv_link
from policies.vllm import VLLM

PAGE_BYTES = 16 * 131072  # llama3-8b: 128 KiB of KV a token, 16-token pages
LONG = 500  # tokens: a victim with more computed swaps, one with fewer recomputes


@dataclasses.dataclass(kw_only=True)
class SwapLongOnes(VLLM):
    """vllm, swapping the victims with long computed contexts and recomputing the rest;
    keeps what it saw."""

    seen: list = dataclasses.field(default_factory=list)

    def preemption_modes(self, view, victims):
        costs = view.preemption_costs(victims)
        modes = ["swap" if tokens >= LONG and fits else "recompute"
                 for tokens, fits in zip(costs.recompute_tokens, costs.swap_fits)]
        self.seen.append((victims.copy(), view.pages_held(victims), costs, modes))
        return modes


def run(policy, **limits):
    run_spec = RunSpec(
        workload=WorkloadSpec(arrival="poisson", num_requests=120, rate=40.0,
                              prompt_len="uniform:200:800", output_len="uniform:50:200"),
        engine=SimEngineSpec(),
        limits=LimitsSpec(max_num_seqs=32, max_num_tokens=1024, num_kv_pages=300, **limits))
    config = scheduler_config(run_spec)
    scheduler = Scheduler(build_workload(run_spec), policy, build_engine(run_spec, config),
                          config)
    result = scheduler.run()
    assert (scheduler.table.state == RequestState.FINISHED).all()
    return result


def test_a_policy_reads_each_victims_costs_and_chooses_its_mode():
    policy = SwapLongOnes()
    result = run(policy, kv_host_gb=50.0)
    link = get_kv_link("pcie4")
    swapped_pages = 0
    modes = []
    for victims, held, costs, chosen in policy.seen:
        np.testing.assert_array_equal(costs.pages, held)
        one_way = link.latency_s + held * PAGE_BYTES / link.bytes_per_s
        np.testing.assert_allclose(costs.swap_out_s, one_way)
        np.testing.assert_allclose(costs.swap_in_s, one_way)
        np.testing.assert_allclose(costs.swap_s, 2 * one_way)
        assert costs.swap_fits.all()  # 50 GB holds every request
        assert (costs.recompute_tokens > 0).all() and costs.pages.size == victims.size
        swapped_pages += sum(int(p) for p, mode in zip(held, chosen) if mode == "swap")
        modes += chosen
    assert {"swap", "recompute"} <= set(modes)  # both kinds of victim came up
    host = result.kv_tiers["host"]
    assert host["swapped_out_pages"] == swapped_pages  # exactly the victims it chose
    assert result.total_recomputed_tokens > 0


def test_without_a_host_tier_swap_is_priced_out():
    policy = SwapLongOnes()
    run(policy)
    assert policy.seen  # the pool is tight: it preempted
    for _, _, costs, chosen in policy.seen:
        assert np.isinf(costs.swap_s).all() and not costs.swap_fits.any()
        assert set(chosen) == {"recompute"}


def test_the_host_tiers_room_decides_swap_fits():
    policy = SwapLongOnes()
    run(policy, kv_host_pages=40)  # victims hold 13 to 63 pages
    pages = np.concatenate([costs.pages for _, _, costs, _ in policy.seen])
    fits = np.concatenate([costs.swap_fits for _, _, costs, _ in policy.seen])
    assert fits.any() and not fits.all()
    assert not fits[pages > 40].any()  # never more than the whole tier
