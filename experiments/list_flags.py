"""`--list_policies`, `--list_routers`, `--list_models`, `--list_hardware`: print the
registered names, one per line, and exit 0.

Each is a special flag, as absl's `--help` is: parsing it prints the list and exits, so
a command needs nothing in its `main` and every other flag may be left out. The names
come from the registries themselves (policies and routers as the built-ins register on
import, the model and hardware presets with their aliases), so they are the values the
corresponding flags accept.
"""

from __future__ import annotations

import sys
from typing import Callable

from absl import flags

import policies  # noqa: F401  (registers the built-in policies and routers)
from orca_jax.cluster.routing import registered_routers
from orca_jax.core.api.policy import registered_policies
from orca_jax.runner.spec import HARDWARE_NAMES, MODEL_PRESETS

# --list_NAME -> (what it lists, the names in the order they print).
LISTINGS: dict[str, tuple[str, Callable[[], list[str]]]] = {
    "policies": ("registered policies (--policy, --policies)",
                 lambda: sorted(registered_policies())),
    "routers": ("registered routers (--router, --prefill_router, --decode_router)",
                lambda: sorted(registered_routers())),
    "models": ("model presets (--model)", lambda: list(MODEL_PRESETS)),
    "hardware": ("hardware presets and aliases (--hardware)", lambda: list(HARDWARE_NAMES)),
}


def registered_names(listing: str) -> str:
    """The names of a listing as a help text's sentence: `Registered: a, b (--list_X).`"""
    return f"Registered: {', '.join(LISTINGS[listing][1]())} (--list_{listing})."


class ListFlag(flags.BooleanFlag):
    """A boolean flag that, when given, prints one listing's names and exits 0."""

    def __init__(self, listing: str) -> None:
        self.listing = listing
        super().__init__(f"list_{listing}", False,
                         f"Print the {LISTINGS[listing][0]}, one per line, and exit.")

    def parse(self, argument: str) -> None:
        if self._parse(argument):
            print("\n".join(LISTINGS[self.listing][1]()))
            sys.exit(0)


for _listing in LISTINGS:
    flags.DEFINE_flag(ListFlag(_listing))
