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

from orca_jax.cluster.replicas import *  # noqa: F401,F403  (the old `orca_jax.cluster` module's names)
