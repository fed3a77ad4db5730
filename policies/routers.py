"""Built-in routers: how a cluster's replicas share the arrivals.

* `round_robin`: request k goes to replica k mod R.
* `least_outstanding`: the replica with the fewest requests routed to it and
  not yet done (a load balancer's least-request rule). Ties go round robin,
  from the replica after the last one chosen, so idle replicas share a light
  load evenly.
* `least_work`: the replica with the fewest tokens still to compute for its
  outstanding requests (prompt not yet prefilled plus output not yet
  generated). It reads each request's output length: an oracle, as `sjf` is,
  and the upper bound for length-aware routing.
* `cache_aware`: SGLang's router rule: the replica whose prefix cache holds
  the most of the request's prompt, unless the load is imbalanced; then, or
  when no replica holds enough of it, the least loaded.
* `prefix_hash`: consistent hashing of the prompt's first block onto a ring of
  virtual nodes, with bounded loads: requests that share a first block meet
  on one replica unless it is over its share.

The gateways' routers are in `policies/gateway_routers.py`:

* `power_of_two`: sgl-router's: two replicas drawn with the run's seed, the one
  with fewer outstanding requests takes the request.
* `length_buckets`: prompts by length (`bounds`) to separate replica groups
  (`replicas`), the least loaded of its group taking each; a disaggregated
  cluster's pools each take their own (`--prefill_router_opts`,
  `--decode_router_opts`).
* `kv_aware`: Dynamo's KV router: cost = `overlap_score_weight` x the prompt
  blocks a replica has not cached + its active blocks; the cheapest, or a
  seeded softmax draw over the costs at a `temperature` above 0.

And in `policies/router_chain.py`:

* `chain`: llm-d's filter → score → pick, each stage a plugin (a
  `RouteFilter`, `RouteScorer` or `RoutePicker`) by name or path, so a
  predicted-latency scorer is a few lines in a file
  (`examples/predicted_latency_scorer.py`).

docs/clusters.md compares them.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import math
from typing import Optional, Sequence, Union

import numpy as np
from numpy.typing import NDArray

from orca_jax.cluster.routing import ClusterView, Router, register_router
from orca_jax.core.requests.request import RequestState


@register_router("round_robin")
@dataclasses.dataclass
class RoundRobin(Router):
    """Deals requests to replicas in turn."""

    # Its choice is its count of earlier choices: a cluster routes ahead (`state_blind`).
    state_blind = True
    _count: int = dataclasses.field(default=0, init=False, repr=False)

    def route(self, view: ClusterView, request: int) -> int:
        del request
        choice = self._count % view.num_replicas
        self._count += 1
        return choice


@dataclasses.dataclass
class LeastLoaded(Router):
    """Routes to the replica with the least `load`; ties go round robin, from the
    replica after the last one chosen. Subclasses define `load`."""

    _last: int = dataclasses.field(default=-1, init=False, repr=False)

    @abc.abstractmethod
    def load(self, view: ClusterView) -> np.ndarray:  # [R]
        """Each replica's load (lower is better)."""

    def route(self, view: ClusterView, request: int) -> int:
        del request
        load = self.load(view)
        order = (self._last + 1 + np.arange(load.size)) % load.size
        self._last = int(order[np.argmin(load[order])])
        return self._last


@register_router("least_outstanding")
@dataclasses.dataclass
class LeastOutstanding(LeastLoaded):
    """Fewest requests not yet done."""

    def load(self, view: ClusterView) -> np.ndarray:
        return view.outstanding()


@register_router("least_work")
@dataclasses.dataclass
class LeastWork(LeastLoaded):
    """Fewest tokens left to compute (an output-length oracle)."""

    def load(self, view: ClusterView) -> np.ndarray:
        work = np.zeros(view.num_replicas, dtype=np.int64)
        for r, replica in enumerate(view.replicas):
            table = replica.requests
            ids = view.outstanding_ids(r)
            ids = ids[table.state[ids] != RequestState.FINISHED]  # unreleased: no work left
            work[r] = int((table.prompt_len[ids] + table.output_len[ids]
                           - table.num_computed[ids]).sum())
        return work


def _least_loaded(load: NDArray[np.int64],  # [R]
                  among: Optional[NDArray[np.bool_]] = None) -> int:  # [R]
    """The least loaded replica (of those in `among`); ties to the lowest index."""
    return int(np.argmin(np.where(among, load, np.iinfo(np.int64).max)
                         if among is not None else load))


@register_router("cache_aware")
@dataclasses.dataclass
class CacheAware(Router):
    """SGLang's cache-aware router (sgl-model-gateway `policies/cache_aware.rs`).

    The load is imbalanced when `max - min > balance_abs_threshold` and
    `max > balance_rel_threshold * min` (outstanding requests); then the request
    goes to the least loaded replica. Otherwise it goes to the replica whose prefix
    cache holds the most tokens of it (`cached_tokens`, read from each replica's
    real cache, where SGLang keeps an approximate tree of the prompts it routed),
    if that is more than `cache_threshold` of its prompt; else to the least loaded.
    Ties go to the least loaded, then the lowest index. Defaults are the gateway's
    (`--cache-threshold 0.3 --balance-abs-threshold 64 --balance-rel-threshold 1.5`).

    Attributes:
      cache_threshold: least fraction of the prompt cached to follow the cache.
      balance_abs_threshold: the outstanding spread above which load may be imbalanced.
      balance_rel_threshold: the max / min outstanding ratio above which it may be.
    """

    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0:
            raise ValueError(
                f"balance_abs_threshold must be >= 0, got {self.balance_abs_threshold}")
        if not self.balance_rel_threshold >= 1.0:
            raise ValueError(
                f"balance_rel_threshold must be >= 1, got {self.balance_rel_threshold}")

    def route(self, view: ClusterView, request: int) -> int:
        load = view.outstanding()  # [R]
        high, low = int(load.max()), int(load.min())
        if high - low > self.balance_abs_threshold and high > self.balance_rel_threshold * low:
            return _least_loaded(load)
        cached = np.array([int(replica.cached_tokens([request])[0])
                           for replica in view.replicas])  # [R]
        best = int(cached.max())
        if best <= self.cache_threshold * int(view.requests.prompt_len[request]):
            return _least_loaded(load)
        return _least_loaded(load, among=cached == best)


def _hash64(data: bytes) -> int:
    """A 64-bit hash that is the same in every process (Python's `hash` of bytes is not)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class HashRing:
    """A consistent-hash ring: each replica owns `num_virtual_nodes` points on it.

    A key belongs to the first point at or after its hash, clockwise. Adding a
    replica moves to it only the keys whose next point is now one of its own,
    about `1 / (R + 1)` of them; the others keep their replica. A replica's points
    are named by its id, so removing one moves only its own keys.

    Args:
      replicas: the replicas' ids (`ClusterView.replica_ids`), or a count R for the
        ids `0..R-1` (>= 1 replica).
      num_virtual_nodes: points per replica (>= 1); more points spread keys more evenly.
    """

    def __init__(self, replicas: Union[int, Sequence[int]], num_virtual_nodes: int) -> None:
        ids = tuple(range(replicas)) if isinstance(replicas, int) else tuple(replicas)
        if len(ids) < 1 or num_virtual_nodes < 1:
            raise ValueError(f"a hash ring needs >= 1 replica and >= 1 virtual node, got "
                             f"{len(ids)} and {num_virtual_nodes}")
        self.replica_ids = ids
        self.num_replicas = len(ids)
        points = [(_hash64(f"replica-{r}-node-{v}".encode()), r)
                  for r in ids for v in range(num_virtual_nodes)]
        points.sort()
        self._points = np.array([p for p, _ in points], dtype=np.uint64)  # [P]
        self._owners = np.array([r for _, r in points], dtype=np.int64)  # [P]

    def replicas_from(self, key: bytes) -> NDArray[np.int64]:  # [R]
        """Every replica's id once, in the order met walking clockwise from `key`'s hash."""
        start = int(np.searchsorted(self._points, np.uint64(_hash64(key))))
        owners = np.roll(self._owners, -start)  # [P] clockwise from the key
        _, first = np.unique(owners, return_index=True)
        return owners[np.sort(first)]


@register_router("prefix_hash")
@dataclasses.dataclass
class PrefixHash(Router):
    """Consistent hashing with bounded loads (Mirrokni, Thorup and Zadimoghaddam, 2018).

    A request's key is its first `prefix_tokens` prompt token ids (one KV page by
    default: the first page's K/V is what requests of one prefix share first). The
    ring gives the replicas in clockwise order from the key; the request goes to the
    first whose outstanding count is under `ceil((1 + epsilon) * (total + 1) / R)`,
    the capacity of consistent hashing with bounded loads (`total + 1`: the
    outstanding requests and this one), so no replica takes more than that share.
    Some replica is always under it. SGLang's gateway has the same policy
    (`prefix_hash`: 256 tokens, load factor 1.25, falling back to the least loaded);
    `epsilon` 0.25 is its load factor. A request without token ids goes to the
    least loaded replica.

    Attributes:
      prefix_tokens: how many leading prompt tokens name the prefix (None: one page).
      epsilon: how far above the mean load a replica may go.
      num_virtual_nodes: ring points per replica.
    """

    prefix_tokens: Optional[int] = None
    epsilon: float = 0.25
    num_virtual_nodes: int = 160
    _ring: Optional[HashRing] = dataclasses.field(default=None, init=False, repr=False)
    # [max id + 1] each ring replica's position in the view the ring was built for
    _positions: NDArray[np.int64] = dataclasses.field(
        default_factory=lambda: np.zeros(0, dtype=np.int64), init=False, repr=False)

    def __post_init__(self) -> None:
        if self.prefix_tokens is not None and self.prefix_tokens < 1:
            raise ValueError(f"prefix_tokens must be >= 1 or None, got {self.prefix_tokens}")
        if not self.epsilon > 0:
            raise ValueError(f"epsilon must be > 0, got {self.epsilon}")
        if self.num_virtual_nodes < 1:
            raise ValueError(f"num_virtual_nodes must be >= 1, got {self.num_virtual_nodes}")

    def capacity(self, load: NDArray[np.int64]) -> int:  # [R]
        """Most outstanding requests a replica may hold once this one is routed."""
        return math.ceil((1 + self.epsilon) * (int(load.sum()) + 1) / load.size)

    def route(self, view: ClusterView, request: int) -> int:
        load = view.outstanding()  # [R]
        tokens = view.requests.spec(request).prompt_tokens
        if tokens is None or tokens.size == 0:
            return _least_loaded(load)
        # The ring's points are named by replica ids: under a planner the view's positions
        # are renumbered as replicas start and stop, and the ids keep each key's replica.
        if self._ring is None or self._ring.replica_ids != view.replica_ids:
            self._ring = HashRing(view.replica_ids, self.num_virtual_nodes)
            self._positions = np.empty(max(view.replica_ids) + 1, dtype=np.int64)
            self._positions[list(view.replica_ids)] = np.arange(view.num_replicas)
        size = self.prefix_tokens or view.replicas[0].page_size
        key = np.asarray(tokens[:size], dtype=np.int64).tobytes()
        order = self._positions[self._ring.replicas_from(key)]  # [R] positions, clockwise
        under = load[order] < self.capacity(load)  # [R]
        return int(order[int(np.argmax(under))])
