"""The rebalancer API: which running or waiting requests move between a cluster's replicas.

A rebalancer is the router's counterpart after placement (Llumnix's global
scheduler): every `--rebalance_interval_s` of virtual time the cluster shows it
every replica's live state (the router's `ClusterView`) and it returns the
migrations to start, each `(request, source, target)`. It is a plugin like a
router: a small class with its knobs as dataclass fields, loaded by registered
name, `package.module:Class` or `file.py:Class` (`--rebalancer`, options in
`--rebalancer_opts`). The built-ins live in `policies/rebalancers.py`;
rebalancers never import jax. `orca_jax.cluster.migration` prices and runs
the moves.

    @register_rebalancer("move_one")
    class MoveOne(Rebalancer):
        def rebalance(self, view: ClusterView) -> list[Migration]:
            running = view.replicas[0].running
            return [Migration(int(running[0]), 0, 1)] if running.size else []
"""

from __future__ import annotations

import abc
from typing import ClassVar, Mapping, NamedTuple, Optional, Sequence

from orca_jax.cluster.routing import ClusterView
from orca_jax.core.api import plugins

_REBALANCERS: dict[str, type["Rebalancer"]] = {}
# How a migration moves a request (`migration.MigrationSpec.mode`): here, beside the API,
# so that a spec can name them without importing the cluster's loop.
MIGRATION_MODES = ("live", "stop_and_copy")


class Migration(NamedTuple):
    """One move a rebalancer asks for."""

    request: int  # request index (arrival order), waiting or running on `source`
    source: int  # the replica holding it
    target: int  # the replica to hold it (another one)


class Rebalancer(abc.ABC):
    """Base class of every rebalancer (see the module docstring)."""

    name: ClassVar[str] = ""

    @abc.abstractmethod
    def rebalance(self, view: ClusterView) -> Sequence[Migration]:
        """The migrations to start now (may be empty).

        `view.migrating()` lists the requests already moving: a migration of one of
        them, or onto a target without room for its computed tokens' pages, is refused.
        """


register_rebalancer = plugins.registrar(_REBALANCERS, Rebalancer, kind="rebalancer",
                                        decorator="register_rebalancer")


def registered_rebalancers() -> dict[str, type[Rebalancer]]:
    """The registered rebalancers by name (a copy; import `policies` for the built-ins)."""
    return dict(_REBALANCERS)


def resolve_rebalancer_class(spec: str) -> type[Rebalancer]:
    """Finds the rebalancer class for a registered name, `module:Class` or `file.py:Class`."""
    return plugins.resolve_class(spec, kind="rebalancer", plural="rebalancers",
                                 registry=_REBALANCERS, base=Rebalancer)


def make_rebalancer(spec: str, options: Optional[Mapping[str, str]] = None) -> Rebalancer:
    """Builds a rebalancer from its spec and string options (`--rebalancer_opts`).

    Raises:
      PolicyLoadError: the spec does not resolve, or an option is unknown or mistyped.
    """
    return plugins.build(resolve_rebalancer_class(spec), options, "rebalancer")
