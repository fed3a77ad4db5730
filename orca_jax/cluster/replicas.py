"""Several replicas behind a global router, on one virtual clock (simulator first).

Each replica is a whole `Scheduler` (its own policy, engine, KV pool and
clock) over the full workload. Requests are routed one at a time, in arrival
order: before routing a request that arrives at time `a`, every replica runs
its iterations up to `a` (`Scheduler.has_work`), so the router sees each
replica's state at the moment the request arrives. The chosen replica keeps
the request; every other one withdraws it (`Scheduler.withdraw`). Once all
requests are routed, each replica runs to the end on its own.

The router is a plugin (`orca_jax.cluster.routing.Router`; built-ins `round_robin`,
`least_outstanding`, `least_work` in `policies/routers.py`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import numpy as np

from orca_jax.results import metrics
from orca_jax.core.engine_api import Engine
from orca_jax.core.plan import PlanError
from orca_jax.core.policy import Policy
from orca_jax.core.request import Request, RequestState
from orca_jax.results.summary import json_value, request_rows, step_rows, write_json, write_jsonl
from orca_jax.cluster.routing import ClusterView, Router, make_router
from orca_jax.core.scheduler import Scheduler, SchedulerConfig


class Cluster:
    """`num_replicas` schedulers behind one router.

    Args:
      requests: the workload.
      num_replicas: replicas (>= 1).
      router: a `Router`, or its spec (registered name, `module:Class`, `file.py:Class`).
      make_policy: a fresh policy per replica (policies keep bookkeeping).
      make_engine: a fresh engine per replica.
      config: every replica's limits.
      router_options: the router's knobs as text, when `router` is a spec.
    """

    def __init__(self, requests: Sequence[Request], *, num_replicas: int,
                 router: Union[Router, str], make_policy: Callable[[], Policy],
                 make_engine: Callable[[], Engine], config: SchedulerConfig,
                 router_options: Optional[Mapping[str, str]] = None) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.router = router if isinstance(router, Router) else make_router(router,
                                                                             router_options)
        self.replicas = [Scheduler(requests, make_policy(), make_engine(), config)
                         for _ in range(num_replicas)]
        table = self.replicas[0].table
        # replica[i]: the replica serving request i (arrival order); -1: rejected up front.
        self.replica = np.full(len(table), -1, dtype=np.int64)
        self.now_s = 0.0  # the arrival being routed
        self._num_rejected = int(np.count_nonzero(table.state == RequestState.REJECTED))
        self._routed = np.zeros(num_replicas, dtype=np.int64)
        self._withdrawn = np.zeros(num_replicas, dtype=np.int64)
        self._not_admitted: list[list[int]] = [[] for _ in range(num_replicas)]
        self.view = ClusterView(self)

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    def outstanding(self) -> np.ndarray:  # [R] int64
        """Requests routed to each replica and not yet done there."""
        done = np.array([r.num_done for r in self.replicas]) - self._withdrawn - self._num_rejected
        return self._routed - done

    def outstanding_ids(self, replica: int) -> np.ndarray:  # [n] int64
        """Requests routed to `replica` and not yet done (see `ClusterView`)."""
        scheduler = self.replicas[replica]
        state = scheduler.table.state
        pending = [i for i in self._not_admitted[replica] if state[i] == RequestState.PENDING]
        self._not_admitted[replica] = pending
        return np.concatenate([np.asarray(pending, dtype=np.int64), scheduler.waiting,
                               scheduler.running, scheduler.unreleased])

    def run(self) -> None:
        """Routes every request at its arrival, then runs each replica to the end."""
        for replica in self.replicas:
            replica.engine.warmup(replica.bucket_config.buckets())
        table = self.replicas[0].table
        for request in np.flatnonzero(table.state == RequestState.PENDING).tolist():
            self.now_s = float(table.arrival_s[request])
            for replica in self.replicas:
                while replica.now_s < self.now_s and replica.has_work(self.now_s):
                    replica.step()
            target = self.router.route(self.view, request)
            if not (isinstance(target, (int, np.integer)) and 0 <= target < self.num_replicas):
                raise PlanError(self.router.name, "replica_out_of_range",
                                f"route() returned {target!r} for request {request}; replicas "
                                f"are 0..{self.num_replicas - 1}")
            target = int(target)
            self.replica[request] = target
            self._routed[target] += 1
            self._not_admitted[target].append(request)
            for index, replica in enumerate(self.replicas):
                if index != target:
                    replica.withdraw([request])
                    self._withdrawn[index] += 1
        for replica in self.replicas:
            while not replica.done:
                replica.step()

    def token_log(self) -> tuple[np.ndarray, np.ndarray]:  # [K] int64, [K] float64
        """Every replica's generated tokens (request index, time), merged in time order."""
        logs = [r.record.token_log() for r in self.replicas]
        req = np.concatenate([np.asarray(q, np.int64) for q, _ in logs])
        time = np.concatenate([np.asarray(t, np.float64) for _, t in logs])
        order = np.argsort(time, kind="stable")
        return req[order], time[order]

    def served(self, field: str) -> np.ndarray:  # [N]
        """`field` of each request's table row on the replica that served it."""
        stacked = np.stack([getattr(r.table, field) for r in self.replicas])  # [R, N]
        return stacked[np.maximum(self.replica, 0), np.arange(stacked.shape[1])]


def cluster_summary(cluster: Cluster, *, ttft_slo_s: Optional[float] = None,
                    tpot_slo_s: Optional[float] = None) -> dict[str, Any]:
    """The cluster's summary.json: metrics over all requests, and each replica's share."""
    first = cluster.replicas[0]
    table = first.table
    token_req, token_time = cluster.token_log()
    summary: dict[str, Any] = {"policy": first.policy.name, "engine": first.engine.name,
                               "num_replicas": cluster.num_replicas,
                               "router": cluster.router.name}
    summary.update(metrics.run_summary(
        table.arrival_s, cluster.served("first_scheduled_s"), cluster.served("first_token_s"),
        cluster.served("finish_s"), table.output_len, token_req, token_time,
        rejected=table.state == RequestState.REJECTED, ttft_slo_s=ttft_slo_s,
        tpot_slo_s=tpot_slo_s))
    steps = [step for replica in cluster.replicas for step in replica.record.steps]
    real = sum(step.num_tokens for step in steps)
    padded = sum(step.num_padded_tokens for step in steps)
    routed_tokens = np.array([table.output_len[cluster.replica == r].sum()
                              for r in range(cluster.num_replicas)], dtype=np.float64)
    summary.update({
        "num_steps": len(steps),
        "padding_fraction": (padded - real) / padded if padded else 0.0,
        "engine_s_total": float(sum(step.step_s for step in steps)),
        "num_preemptions": sum(r.record.num_preemptions for r in cluster.replicas),
        "virtual_end_s": max(r.now_s for r in cluster.replicas),
        "replica_num_requests": [int(np.count_nonzero(cluster.replica == r))
                                 for r in range(cluster.num_replicas)],
        "replica_num_steps": [len(r.record.steps) for r in cluster.replicas],
        # Most output tokens routed to one replica over the mean: 1.0 is perfect balance.
        "load_imbalance": (float(routed_tokens.max() / routed_tokens.mean())
                           if routed_tokens.sum() else 1.0),
    })
    return {k: json_value(v) for k, v in summary.items()}


def write_cluster_results(out_dir: os.PathLike, cluster: Cluster, summary: Mapping[str, Any],
                          config: Mapping[str, Any]) -> Path:
    """Writes config.json, summary.json, and requests.jsonl / steps.jsonl with a `replica` field."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "config.json", config)
    rows: list[dict[str, Any]] = [{} for _ in cluster.replica]
    serving = np.maximum(cluster.replica, 0)  # rejected requests: replica 0's rows
    for index, replica in enumerate(cluster.replicas):
        mine = np.flatnonzero(serving == index).tolist()
        for i, row in zip(mine, request_rows(replica, mine)):
            rows[i] = {**row, "replica": int(cluster.replica[i])}
    write_jsonl(out / "requests.jsonl", rows)
    write_jsonl(out / "steps.jsonl", [{"replica": index, **row}
                                      for index, replica in enumerate(cluster.replicas)
                                      for row in step_rows(replica)])
    write_json(out / "summary.json", summary)
    return out
