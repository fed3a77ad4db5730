"""The `chain` router: llm-d's filter → score → pick, each stage a small plugin.

Filters drop replicas that must not take the request; scorers score each
replica left (higher is better), their weighted sum making its score; a picker
chooses one. Each stage is a `RouteFilter`, `RouteScorer` or `RoutePicker`
(`orca_jax.cluster.routing`), given by registered name, `package.module:Class`
or `path/to/file.py:Class`, so a new scorer is a few lines in a file
(`examples/predicted_latency_scorer.py`).

Built-in stages:
* filters: `load_bound` (fewer than `max_outstanding` requests), `kv_headroom`
  (at least `min_free_fraction` of its KV pages free);
* scorers, each in [0, 1] as llm-d's: `queue` (fewest outstanding requests
  best), `prefix_cache` (the fraction of the prompt its prefix cache holds),
  `kv_usage` (the fraction of its KV pages free);
* pickers: `max` (the highest score, a tie drawn with the run's seed),
  `random` (uniform), `softmax` (drawn with chances `exp((score - max) /
  temperature)`; temperature 0: `max`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np
from numpy.typing import NDArray

from orca_jax.cluster.routing import (
    ClusterView,
    RouteFilter,
    RoutePicker,
    Router,
    RouteScorer,
    RouteStage,
    register_route_filter,
    register_route_picker,
    register_route_scorer,
    register_router,
    resolve_route_stage_class,
)
from orca_jax.core.api import plugins
from orca_jax.core.api.plugins import parse_options
from orca_jax.core.plans.plan import PlanError
from policies.gateway_routers import seeded_rng


def _stage_specs(text: str) -> list[str]:
    """`a+b+c` as stage specs (`+`, as `,` separates the router's options)."""
    return [item.strip() for item in text.split("+") if item.strip()]


@register_router("chain")
@dataclasses.dataclass
class Chain(Router):
    """llm-d's filter → score → pick chain (see the module docstring).

    Each request starts with every replica as a candidate. Each filter in turn keeps
    some of them; a filter that would keep none is passed over (every replica is
    over the bound: the request still goes somewhere, as a gateway queues it rather
    than drop it). Each scorer scores the candidates; their weighted sum goes to the
    picker, which chooses one. A scorer that gives NaN or inf, a stage that returns
    the wrong shape, or a picker that chooses no candidate breaks a rule (`PlanError`
    of kind `router`, naming the stage) before the request is routed.

    Attributes:
      filters: the filters in order, `+`-separated (each a registered name,
        package.module:Class or path/to/file.py:Class); empty: none.
      scorers: the scorers, `+`-separated, each optionally with a weight after `*`
        (`queue*2+prefix_cache`; weight 1 by default).
      picker: the picker.
      stage_opts: the stages' knobs, `;`-separated `stage.knob=value` (the stage as
        written in its list, or its name: `load_bound.max_outstanding=8`).
    """

    filters: str = ""
    scorers: str = "queue"
    picker: str = "max"
    stage_opts: str = ""
    _filters: list[RouteFilter] = dataclasses.field(default_factory=list, init=False,
                                                    repr=False)
    _scorers: list[tuple[RouteScorer, float]] = dataclasses.field(default_factory=list,
                                                                  init=False, repr=False)
    _picker: Optional[RoutePicker] = dataclasses.field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        scorers = []
        for item in _stage_specs(self.scorers):
            spec, _, weight = item.rpartition("*") if "*" in item else (item, "", "1")
            try:
                value = float(weight)
            except ValueError:
                value = math.nan
            if not math.isfinite(value):
                raise ValueError(f"scorer {item!r}: weight {weight!r} is not a finite number")
            scorers.append((spec.strip(), value))
        if not scorers:
            raise ValueError("scorers is empty: give at least one scorer")
        specs = ([("filter", spec) for spec in _stage_specs(self.filters)]
                 + [("scorer", spec) for spec, _ in scorers] + [("picker", self.picker.strip())])
        options = self._options_by_stage()
        built = []
        for kind, spec in specs:
            cls = resolve_route_stage_class(kind, spec)
            knobs = {**options.pop(cls.name, {}), **options.pop(spec, {})}
            built.append(plugins.build(cls, knobs, kind))
        if options:
            raise ValueError(f"stage_opts names {', '.join(map(repr, sorted(options)))}, not a "
                             f"stage of this chain ({', '.join(spec for _, spec in specs)})")
        self._filters = [stage for stage in built if isinstance(stage, RouteFilter)]
        self._scorers = list(zip([s for s in built if isinstance(s, RouteScorer)],
                                 [weight for _, weight in scorers]))
        self._picker = built[-1]  # type: ignore[assignment]

    def _options_by_stage(self) -> dict[str, dict[str, str]]:
        """`stage_opts` as {stage: {knob: value}}."""
        options: dict[str, dict[str, str]] = {}
        for item in filter(None, (part.strip() for part in self.stage_opts.split(";"))):
            key, sep, value = item.partition("=")
            stage, dot, knob = key.strip().rpartition(".")
            if not sep or not dot or not stage or not knob:
                raise ValueError(f"stage_opts item {item!r} is not stage.knob=value")
            options.setdefault(stage, {}).update(parse_options(f"{knob}={value}"))
        return options

    @property
    def stages(self) -> list[RouteStage]:
        """The chain's stages, built: filters, scorers, then the picker."""
        return [*self._filters, *(scorer for scorer, _ in self._scorers), self._picker]

    def _broke(self, rule: str, detail: str) -> PlanError:
        return PlanError(self.name, rule, detail, kind="router")

    def candidates(self, view: ClusterView, request: int) -> NDArray[np.int64]:  # [C]
        """The replicas the filters leave for `request`."""
        candidates = np.arange(view.num_replicas)
        for stage in self._filters:
            keep = np.asarray(stage.keep(view, request, candidates))
            if keep.shape != candidates.shape or keep.dtype != np.bool_:
                raise self._broke("filter_shape", f"filter {stage.name!r} gave {keep.dtype} "
                                  f"{keep.shape} for {candidates.size} candidates (request "
                                  f"{request}); it must give one bool per candidate")
            if keep.any():  # a filter that would leave none is passed over
                candidates = candidates[keep]
        return candidates

    def scores(self, view: ClusterView, request: int,
               candidates: NDArray[np.int64]) -> NDArray[np.float64]:  # [C] -> [C]
        """The candidates' weighted score sum.

        Raises:
          PlanError: a scorer gave the wrong shape, or NaN or inf (rule `score_not_finite`,
            naming the scorer, the replica and the request).
        """
        total = np.zeros(candidates.size)
        for stage, weight in self._scorers:
            score = np.asarray(stage.score(view, request, candidates), dtype=np.float64)
            if score.shape != candidates.shape:
                raise self._broke("score_shape", f"scorer {stage.name!r} gave shape "
                                  f"{score.shape} for {candidates.size} candidates (request "
                                  f"{request})")
            bad = np.flatnonzero(~np.isfinite(score))
            if bad.size:
                raise self._broke("score_not_finite", f"scorer {stage.name!r} gave "
                                  f"{score[bad[0]]} for replica {candidates[bad[0]]} (request "
                                  f"{request}); scores must be finite numbers")
            total += weight * score
        return total

    def route(self, view: ClusterView, request: int) -> int:
        assert self._picker is not None
        candidates = self.candidates(view, request)
        scores = self.scores(view, request, candidates)
        choice = self._picker.pick(view, request, candidates, scores)
        if not (isinstance(choice, (int, np.integer)) and int(choice) in candidates):
            raise self._broke("pick_not_candidate", f"picker {self._picker.name!r} chose "
                              f"{choice!r} for request {request}; candidates are "
                              f"{candidates.tolist()}")
        return int(choice)


# ------------------------------------------------------------------ filters
@register_route_filter("load_bound")
@dataclasses.dataclass
class LoadBound(RouteFilter):
    """Keeps the replicas with fewer than `max_outstanding` outstanding requests.

    Attributes:
      max_outstanding: the most requests a replica may hold with this one.
    """

    max_outstanding: int = 64

    def __post_init__(self) -> None:
        if self.max_outstanding < 1:
            raise ValueError(f"max_outstanding must be >= 1, got {self.max_outstanding}")

    def keep(self, view: ClusterView, request: int,
             replicas: NDArray[np.int64]) -> NDArray[np.bool_]:  # [C] -> [C]
        return view.outstanding()[replicas] < self.max_outstanding


@register_route_filter("kv_headroom")
@dataclasses.dataclass
class KVHeadroom(RouteFilter):
    """Keeps the replicas with at least `min_free_fraction` of their KV pages free.

    Attributes:
      min_free_fraction: the least fraction of the pool free.
    """

    min_free_fraction: float = 0.1

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_free_fraction <= 1.0:
            raise ValueError(f"min_free_fraction must be in [0, 1], got {self.min_free_fraction}")

    def keep(self, view: ClusterView, request: int,
             replicas: NDArray[np.int64]) -> NDArray[np.bool_]:  # [C] -> [C]
        free = np.array([view.replicas[r].num_free_pages / view.replicas[r].num_kv_pages
                         for r in replicas])
        return free >= self.min_free_fraction


# ------------------------------------------------------------------ scorers
@register_route_scorer("queue")
@dataclasses.dataclass
class QueueScorer(RouteScorer):
    """llm-d's queue scorer: `(max - q) / (max - min)` of the candidates' outstanding
    requests `q` (1 for the least loaded, 0 for the most; all 1 when equal)."""

    def score(self, view: ClusterView, request: int,
              replicas: NDArray[np.int64]) -> NDArray[np.float64]:  # [C] -> [C]
        load = view.outstanding()[replicas].astype(np.float64)
        spread = load.max() - load.min()
        return np.ones(load.size) if spread == 0 else (load.max() - load) / spread


@register_route_scorer("prefix_cache")
@dataclasses.dataclass
class PrefixCacheScorer(RouteScorer):
    """The fraction of the request's prompt each replica's prefix cache holds."""

    def score(self, view: ClusterView, request: int,
              replicas: NDArray[np.int64]) -> NDArray[np.float64]:  # [C] -> [C]
        prompt = max(int(view.requests.prompt_len[request]), 1)
        return np.array([int(view.replicas[r].cached_tokens([request])[0]) / prompt
                         for r in replicas])


@register_route_scorer("kv_usage")
@dataclasses.dataclass
class KVUsageScorer(RouteScorer):
    """The fraction of each replica's KV pages free (llm-d's KV-cache utilization scorer)."""

    def score(self, view: ClusterView, request: int,
              replicas: NDArray[np.int64]) -> NDArray[np.float64]:  # [C] -> [C]
        return np.array([view.replicas[r].num_free_pages / view.replicas[r].num_kv_pages
                         for r in replicas])


# ------------------------------------------------------------------ pickers
@dataclasses.dataclass
class _SeededPicker(RoutePicker):
    """A picker drawing with a generator seeded by the run's seed."""

    _rng: Optional[np.random.Generator] = dataclasses.field(default=None, init=False,
                                                            repr=False)

    def rng(self, view: ClusterView) -> np.random.Generator:
        self._rng = seeded_rng(self._rng, view)
        return self._rng


@register_route_picker("max")
@dataclasses.dataclass
class MaxPicker(_SeededPicker):
    """The highest score; a tie drawn with the run's seed (llm-d's max-score picker)."""

    def pick(self, view: ClusterView, request: int, replicas: NDArray[np.int64],  # [C]
             scores: NDArray[np.float64]) -> int:  # [C]
        best = replicas[scores == scores.max()]
        return int(best[0] if best.size == 1 else self.rng(view).choice(best))


@register_route_picker("random")
@dataclasses.dataclass
class RandomPicker(_SeededPicker):
    """A candidate drawn uniformly (the scores unread)."""

    def pick(self, view: ClusterView, request: int, replicas: NDArray[np.int64],  # [C]
             scores: NDArray[np.float64]) -> int:  # [C]
        return int(self.rng(view).choice(replicas))


@register_route_picker("softmax")
@dataclasses.dataclass
class SoftmaxPicker(MaxPicker):
    """A candidate drawn with chances proportional to `exp((score - max) / temperature)`.

    Attributes:
      temperature: how far from the best the draw strays (0: `max`).
    """

    temperature: float = 0.1

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")

    def pick(self, view: ClusterView, request: int, replicas: NDArray[np.int64],  # [C]
             scores: NDArray[np.float64]) -> int:  # [C]
        if self.temperature == 0:
            return super().pick(view, request, replicas, scores)
        weights = np.exp((scores - scores.max()) / self.temperature)
        return int(self.rng(view).choice(replicas, p=weights / weights.sum()))
