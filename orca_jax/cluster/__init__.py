"""Several replicas behind a global router, on one virtual clock.

Owns the router plugin API (`routing`: `Router`, `ClusterView`) and the
cluster that runs one scheduler per replica and routes each arrival
(`replicas`).

May import: numpy, `orca_jax.core`.
"""

from orca_jax.cluster.replicas import *  # noqa: F401,F403  (the old `orca_jax.cluster` module's names)
