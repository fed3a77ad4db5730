"""Several replicas behind a global router, on one virtual clock.

Owns the router plugin API (`routing`: `Router`, `ClusterView`), the one
discrete-event loop every topology runs on (`event_loop`: arrivals, replica
steps, and each topology's own event kinds), the cluster that runs one
scheduler per replica and routes each arrival (`replicas`), and the
disaggregated cluster of a prefill and a decode pool (`disaggregated`, its
joined result in `disaggregated_result`) with its priced KV transfers
(`transfers`) and the handoff of a request's KV between them (`handoff`, on
`Scheduler.export_request` / `import_request`), and the live migration of
requests between colocated replicas that a rebalancer plugin asks for
(`rebalancing`: `Rebalancer`, `Migration`; `migration`: the priced moves).

May import: numpy, `orca_jax.core`, `orca_jax.specs` (model shapes and KV links).
"""

import importlib

# The old `orca_jax.cluster` module's names (`replicas.__all__`, which says the same:
# tests/test_version_and_old_names.py). They are loaded when first asked for, not when the
# package is: `import orca_jax` reaches this package for `routing`'s plugin API, and a
# run of one replica needs none of the cluster's loop, topologies or migrations.
__all__ = ["Cluster", "ClusterView", "Router", "make_router", "route_checked"]


def __getattr__(name: str) -> object:
    """One of `__all__`, from `replicas` (imported on the first such question)."""
    if name in __all__:
        return getattr(importlib.import_module("orca_jax.cluster.replicas"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
