"""The routers production gateways ship, that cluster-scheduling papers compare against.

* `power_of_two`: sgl-router's policy: two distinct replicas sampled with the
  run's seed, the one with fewer outstanding requests takes the request.
* `length_buckets`: short and long prompts to separate replica groups, the
  least loaded of its group taking each request (bucket bounds and group sizes
  are options; in a disaggregated cluster the prefill and decode pools each
  have their own router and options).
* `kv_aware`: Dynamo's KV router: a replica's cost is the request's prompt
  blocks it has not cached plus the KV blocks of its outstanding requests; the
  cheapest takes the request, or, at a temperature above 0, one sampled by a
  softmax over the costs.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
from numpy.typing import NDArray

from orca_jax.cluster.routing import ClusterView, Router, register_router
from orca_jax.core.plans.plan import PlanError
from orca_jax.core.requests.request import RequestState

_FINISHED = int(RequestState.FINISHED)


def seeded_rng(rng: Optional[np.random.Generator], view: ClusterView) -> np.random.Generator:
    """`rng`, or on a router's first call a generator seeded with the run's `--seed`
    (so a rerun repeats every draw and a sweep over seeds varies them)."""
    return rng if rng is not None else np.random.default_rng(view.seed)


def parse_counts(text: str, what: str) -> tuple[int, ...]:
    """`a+b+c` as positive ints (`+`, as `,` separates the router's options).

    Raises:
      ValueError: an item is not a positive int (the message names `what`).
    """
    items = [item.strip() for item in text.split("+")] if text.strip() else []
    values = []
    for item in items:
        try:
            value = int(item)
        except ValueError:
            raise ValueError(f"{what} {text!r}: {item!r} is not an int") from None
        if value < 1:
            raise ValueError(f"{what} {text!r}: {value} is not >= 1")
        values.append(value)
    return tuple(values)


def active_blocks(view: ClusterView) -> NDArray[np.int64]:  # [R]
    """KV blocks (pages) each replica's outstanding, unfinished requests hold or will
    hold: each its prompt and the output it has generated, in whole pages."""
    blocks = np.zeros(view.num_replicas, dtype=np.int64)
    for r, replica in enumerate(view.replicas):
        ids = view.outstanding_ids(r)
        ids = ids[replica.requests.state[ids] != _FINISHED]
        page = replica.page_size
        blocks[r] = int(((replica.requests.num_known(ids) + page - 1) // page).sum())
    return blocks


@register_router("power_of_two")
@dataclasses.dataclass
class PowerOfTwo(Router):
    """Power of two choices (sgl-router's `power_of_two`; Mitzenmacher, 2001).

    Two distinct replicas are drawn uniformly with a generator seeded by the run's
    seed; the one with fewer outstanding requests takes the request, the first drawn
    on a tie (as the gateway). With one replica it is that one. It reads two loads,
    not all of them, and still avoids most of a random choice's imbalance.
    """

    _rng: Optional[np.random.Generator] = dataclasses.field(default=None, init=False,
                                                            repr=False)

    def sample(self, view: ClusterView) -> tuple[int, int]:
        """The two replicas drawn for this request (distinct, in draw order)."""
        self._rng = seeded_rng(self._rng, view)
        first, second = self._rng.choice(view.num_replicas, size=2, replace=False)
        return int(first), int(second)

    def route(self, view: ClusterView, request: int) -> int:
        del request
        if view.num_replicas == 1:
            return 0
        first, second = self.sample(view)
        load = view.outstanding()  # [R]
        return second if load[second] < load[first] else first


@register_router("length_buckets")
@dataclasses.dataclass
class LengthBuckets(Router):
    """Prompts by length to separate replica groups (sgl-router's `bucket` policy, with
    fixed bounds where the gateway moves them with load).

    Bucket i takes the prompts with `bounds[i-1] < prompt_len <= bounds[i]` (the first
    from 0, the last without an upper bound) and owns the next `replicas[i]`
    replicas, in index order; the least outstanding of them takes the request (ties
    round robin within the group, from after its last choice). A long prompt never
    shares a replica with short ones, so short requests do not queue behind long
    prefills. In a disaggregated cluster each pool has its own router
    (`--prefill_router`, `--decode_router`, each with its options): length buckets on
    one pool, or both with their own bounds.

    Attributes:
      bounds: the buckets' upper prompt-length bounds in tokens, ascending, `+`-separated
        (`512+4096`: three buckets).
      replicas: replicas per bucket, `+`-separated, in bucket order, summing to the
        pool's replicas; empty: an even split, the longer buckets taking the rest.
    """

    bounds: str = "1024"
    replicas: str = ""
    _bounds: tuple[int, ...] = dataclasses.field(default=(), init=False, repr=False)
    _sizes: tuple[int, ...] = dataclasses.field(default=(), init=False, repr=False)
    _groups: list[NDArray[np.int64]] = dataclasses.field(default_factory=list, init=False,
                                                         repr=False)
    _last: list[int] = dataclasses.field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        self._bounds = parse_counts(self.bounds, "bounds")
        if not self._bounds:
            raise ValueError("bounds is empty: give at least one bound (two buckets)")
        if any(a >= b for a, b in zip(self._bounds, self._bounds[1:])):
            raise ValueError(f"bounds {self.bounds!r} are not strictly ascending")
        self._sizes = parse_counts(self.replicas, "replicas")
        if self._sizes and len(self._sizes) != len(self._bounds) + 1:
            raise ValueError(f"replicas {self.replicas!r} gives {len(self._sizes)} groups for "
                             f"{len(self._bounds) + 1} buckets (bounds {self.bounds!r})")

    @property
    def num_buckets(self) -> int:
        return len(self._bounds) + 1

    def bucket(self, prompt_len: int) -> int:
        """The bucket of a prompt of `prompt_len` tokens."""
        return int(np.searchsorted(np.asarray(self._bounds), prompt_len, side="left"))

    def groups(self, num_replicas: int) -> list[NDArray[np.int64]]:
        """Each bucket's replica indices, for a pool of `num_replicas`.

        Raises:
          ValueError: the groups do not fit the pool.
        """
        sizes = self._sizes
        if not sizes:
            if num_replicas < self.num_buckets:
                raise ValueError(f"{self.num_buckets} buckets need >= {self.num_buckets} "
                                 f"replicas, the pool has {num_replicas}")
            base, rest = divmod(num_replicas, self.num_buckets)
            sizes = tuple(base + (i >= self.num_buckets - rest) for i in range(self.num_buckets))
        if sum(sizes) != num_replicas:
            raise ValueError(f"replicas {self.replicas!r} sums to {sum(sizes)}, the pool has "
                             f"{num_replicas}")
        edges = np.cumsum((0,) + sizes)
        return [np.arange(edges[i], edges[i + 1]) for i in range(len(sizes))]

    def route(self, view: ClusterView, request: int) -> int:
        if not self._groups:
            try:
                self._groups = self.groups(view.num_replicas)
            except ValueError as e:  # on the first arrival, before anything is routed
                raise PlanError(self.name, "bucket_replicas", str(e), kind="router") from None
            self._last = [-1] * len(self._groups)
        b = self.bucket(int(view.requests.prompt_len[request]))
        group = self._groups[b]
        load = view.outstanding()[group]  # [G]
        order = (self._last[b] + 1 + np.arange(group.size)) % group.size
        self._last[b] = int(order[np.argmin(load[order])])
        return int(group[self._last[b]])


@register_router("kv_aware")
@dataclasses.dataclass
class KVAware(Router):
    """Dynamo's KV router (`--router-mode kv`): the cheapest replica by a KV cost.

    A replica's cost is `overlap_score_weight * prefill_blocks + decode_blocks`:
    `prefill_blocks` are the request's prompt blocks it has not cached (its prompt
    minus the tokens that replica's prefix cache holds, in pages), `decode_blocks`
    the pages its outstanding, unfinished requests hold or will hold (`active
    blocks`). At temperature 0 the cheapest takes the request (a tie drawn at
    random with the run's seed, as Dynamo draws); above 0 a replica is drawn with
    probability proportional to `exp(-(cost - min) / ((max - min) * temperature))`,
    the costs scaled to [0, 1] first as Dynamo's `softmax_sample` does (all equal:
    uniform). Dynamo counts the new request's own blocks in each replica's decode
    blocks too: the same on every replica, so it changes no choice.

    Attributes:
      overlap_score_weight: weight of the uncached prompt blocks against the active
        ones (Dynamo's `--kv-overlap-score-weight`; 0: load balancing alone).
      temperature: softmax temperature over the scaled costs (Dynamo's
        `--router-temperature`; 0: the cheapest).
    """

    overlap_score_weight: float = 1.0
    temperature: float = 0.0
    _rng: Optional[np.random.Generator] = dataclasses.field(default=None, init=False,
                                                            repr=False)

    def __post_init__(self) -> None:
        if not self.overlap_score_weight >= 0:
            raise ValueError(f"overlap_score_weight must be >= 0, got {self.overlap_score_weight}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")

    def costs(self, view: ClusterView, request: int) -> NDArray[np.float64]:  # [R]
        """Each replica's cost for `request` (lower is better)."""
        prompt = int(view.requests.prompt_len[request])
        cached = np.array([int(replica.cached_tokens([request])[0])
                           for replica in view.replicas])  # [R]
        pages = np.array([replica.page_size for replica in view.replicas])  # [R]
        prefill_blocks = (prompt - cached) / pages
        return self.overlap_score_weight * prefill_blocks + active_blocks(view)

    def probabilities(self, costs: NDArray[np.float64]) -> NDArray[np.float64]:  # [R] -> [R]
        """The chance of each replica at this temperature (> 0)."""
        low, spread = costs.min(), costs.max() - costs.min()
        if spread == 0:
            return np.full(costs.size, 1.0 / costs.size)
        weights = np.exp(-(costs - low) / (spread * self.temperature))
        return weights / weights.sum()

    def route(self, view: ClusterView, request: int) -> int:
        costs = self.costs(view, request)
        self._rng = seeded_rng(self._rng, view)
        if self.temperature == 0:
            cheapest = np.flatnonzero(costs == costs.min())
            return int(cheapest[0] if cheapest.size == 1 else self._rng.choice(cheapest))
        return int(self._rng.choice(costs.size, p=self.probabilities(costs)))
