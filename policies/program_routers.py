"""A router for agent programs: a program's calls go where its context is (Autellix's balancer).

* `program_affinity`: a program's first call goes to the least loaded replica; each
  later call goes to the replica that took the program's previous call (its
  prompt is that call's prompt and answer plus a tool's output, so that
  replica's prefix cache holds most of it), unless that replica's load passes a
  bound: then to the least loaded, which the program follows from then on.

Autellix (Luo et al., arXiv 2502.13965, its load balancer) sends a program's long
calls to the engine that served the program before and short ones to the least
loaded engine; here every call follows its program while the bound holds, as a
call's length alone does not say whether its history is worth the move
(docs/programs.md, docs/clusters.md).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from orca_jax.cluster.routing import ClusterView, Router, register_router


@register_router("program_affinity")
@dataclasses.dataclass
class ProgramAffinity(Router):
    """A program's calls stay on one replica while its load is within a bound.

    A replica is *over the bound* when its outstanding requests exceed the least
    loaded replica's by more than `max_excess`. A call of a program whose previous
    call went to a replica not over the bound goes there; otherwise (the
    program's first call, a request of no program, a replica over the bound, or
    one that takes no requests now: a planner stopped or is draining it) it goes
    to the least loaded replica (ties to the lowest index), and the
    program's later calls follow it there.

    Attributes:
      max_excess: outstanding requests a program's replica may hold above the least
        loaded one's and still take the program's next call (0: it must be a least
        loaded one).
    """

    max_excess: int = 8
    # each program's replica id (`ClusterView.replica_ids`), that of its latest call
    _home: dict[int, int] = dataclasses.field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_excess < 0:
            raise ValueError(f"max_excess must be >= 0, got {self.max_excess}")

    def over_bound(self, load: np.ndarray) -> np.ndarray:  # [R] -> [R]
        """Which replicas may not take a program's next call at these loads."""
        return load - load.min() > self.max_excess

    def route(self, view: ClusterView, request: int) -> int:
        load = view.outstanding()  # [R]
        program = view.requests.spec(request).program_id
        # A home is kept by replica id: under a planner a position may name another
        # replica once one starts or stops (`ClusterView.replica_ids`).
        home_id = self._home.get(int(program)) if program is not None else None
        home = None if home_id is None else view.position_of(home_id)
        if home is not None and not self.over_bound(load)[home]:
            return home
        choice = int(np.argmin(load))
        if program is not None:
            self._home[int(program)] = view.replica_ids[choice]
        return choice
