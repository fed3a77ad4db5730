"""VTC: the service of two backlogged tenants stays within the counter bound.

The bound this implementation obeys. Service W is weighted tokens: w_in per
prompt token, w_out per output token. VTC's counters charge exactly that (a
prompt when its request is admitted, an output token in the step that samples
it), so while two tenants f, g stay backlogged their counters move with their
service. Take the last admission of an f request: f had the smallest counter, so
afterwards c_f - c_g <= w_in * L_in (that prompt). From then on c_f grows only
by the outputs of f's requests already in the batch, at most B of them
(the batch cap) with at most L_out tokens each. Hence, at every step,

    |c_f - c_g| <= U = w_in * L_in + w_out * B * L_out,

and over any interval in which both stay backlogged the service difference is
at most 2U (the paper's 2 * max(w_in * L_in, w_out * M), with the in-flight
output B * L_out in place of the KV capacity M and a sum in place of the max,
since here a prompt charge and in-flight outputs can add up).
"""

import numpy as np

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
from orca_jax.sim.cost_model import CostModelConfig
from orca_jax.sim.engine import SimEngine

W_IN, W_OUT, CAP = 1.0, 2.0, 2


def service_trace(requests, policy):
    """Runs step by step; returns per step (service of tenants a and b, who is still waiting)."""
    scheduler = Scheduler(requests, make_policy(policy),
                          SimEngine(CostModelConfig(mode="fixed", step_time_s=1.0)),
                          SchedulerConfig(limits=StepLimits(max_num_seqs=CAP, max_num_tokens=64,
                                                            max_model_len=64),
                                          kv=KVConfig(num_kv_pages=512, page_size=4)))
    table = scheduler.table
    tenant = np.array([r.tenant == "b" for r in table.specs], dtype=np.int64)
    services, backlogged, num_seqs = [], [], []
    while not scheduler.done:
        scheduler.step()
        prompts_done = np.where(table.num_generated > 0, table.prompt_len, 0)
        per_request = W_IN * prompts_done + W_OUT * table.num_generated
        services.append(np.bincount(tenant, weights=per_request, minlength=2))
        waiting = tenant[table.state == RequestState.WAITING]
        backlogged.append((0 in waiting, 1 in waiting))
        num_seqs.append(scheduler.record.steps[-1].num_seqs)
    return np.array(services), np.array(backlogged), np.array(num_seqs), scheduler.now_s


def test_two_backlogged_tenants_stay_within_the_bound_and_fcfs_does_not():
    # Tenant a's long requests all come first: FCFS would serve all of them before b.
    a = [Request(id=i, arrival_s=0.0, prompt_len=16, output_len=24, tenant="a")
         for i in range(12)]
    b = [Request(id=100 + i, arrival_s=0.0, prompt_len=4, output_len=6, tenant="b")
         for i in range(40)]
    bound = W_IN * 16 + W_OUT * CAP * 24  # U = 112
    services, backlogged, _, _ = service_trace(a + b, "vtc")
    both = backlogged.all(axis=1)
    assert both.sum() > 100  # a long window to hold the bound over
    gap = services[both, 0] - services[both, 1]
    assert np.abs(gap).max() <= bound
    assert gap.max() - gap.min() <= 2 * bound  # service difference over any sub-interval
    fcfs, fcfs_backlogged, _, _ = service_trace(a + b, "orca")
    fcfs_gap = np.abs(np.subtract(*fcfs[fcfs_backlogged.all(axis=1)].T))
    assert fcfs_gap.max() > 2 * bound


def test_a_lone_tenant_gets_all_service_and_a_newcomer_is_lifted():
    # Tenant a is alone for 60 steps, then b arrives with as much work as the window needs.
    a = [Request(id=i, arrival_s=0.0, prompt_len=16, output_len=24, tenant="a")
         for i in range(30)]
    b = [Request(id=100 + i, arrival_s=60.0, prompt_len=4, output_len=6, tenant="b")
         for i in range(30)]
    bound = W_IN * 16 + W_OUT * CAP * 24
    services, backlogged, num_seqs, _ = service_trace(a + b, "vtc")
    # Work conserving: alone, a fills the batch every step although its counter runs ahead.
    np.testing.assert_array_equal(num_seqs[:60], CAP)
    np.testing.assert_array_equal(services[:60, 1], 0.0)
    # Pairs of a's requests start at t=0, 24, 48: 6 prompts, 4 whole outputs and 2 halves.
    np.testing.assert_array_equal(services[59], [6 * 16 + W_OUT * (4 * 24 + 2 * 12), 0.0])
    # b is lifted to a's counter on arrival: no catching up on 60 s of a's service.
    start = services[59]
    window = backlogged[60:].all(axis=1)
    gained = services[60:][window] - start
    difference = gained[:, 1] - gained[:, 0]
    assert window.sum() > 50
    assert np.abs(difference).max() <= 2 * bound
