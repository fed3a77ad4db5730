"""Preemption: what happens to a victim's KV. Modes are registered by name.

A policy names the mode of each victim (`Policy.preemption_modes`); the core
preempts with `preempt`, the one preemption function: the mode takes the
victims' KV off the device and the request counts a preemption. The core also
calls it when requests received with their KV wait while their pages block
every admission (they recompute, as if preempted). The one built-in mode is
`recompute` (vLLM's default): the pages are freed and the request computes its
context again when readmitted. A plugin adds a mode with
`register_preemption_mode` (a `swap` mode moves the pages down the
`TierChain` instead, and the request resumes where it was).
"""

from __future__ import annotations

from typing import Protocol, Sequence, Union

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.kv.memory import KVMemory

RECOMPUTE = "recompute"


class PreemptionMode(Protocol):
    """How a victim's KV leaves the device."""

    def evict(self, memory: KVMemory, ids: NDArray[np.int64]) -> float:  # [n]
        """Takes these requests' KV off the device (they hold pages there, or none);
        returns the seconds the move costs."""
        ...


class Recompute:
    """The victims' pages are freed; each recomputes its context when readmitted."""

    def evict(self, memory: KVMemory, ids: NDArray[np.int64]) -> float:  # [n]
        memory.pool.free(ids)
        memory.table.num_computed[ids] = 0
        return 0.0


_MODES: dict[str, PreemptionMode] = {RECOMPUTE: Recompute()}


def register_preemption_mode(name: str, mode: PreemptionMode) -> None:
    """Makes `mode` available under `name` (a policy names it per victim)."""
    if name in _MODES:
        raise ValueError(f"preemption mode {name!r} is already registered")
    _MODES[name] = mode


def unregister_preemption_mode(name: str) -> None:
    """Removes a mode a plugin registered (the built-in one stays)."""
    if name == RECOMPUTE or name not in _MODES:
        raise ValueError(f"preemption mode {name!r} is not a plugin's registered mode")
    del _MODES[name]


def preemption_modes() -> list[str]:
    """The registered modes' names."""
    return sorted(_MODES)


def _mode(name: str) -> PreemptionMode:
    mode = _MODES.get(name)
    if mode is None:
        raise ValueError(f"preemption mode {name!r} is not one of {preemption_modes()}")
    return mode


def preempt(memory: KVMemory, ids: NDArray[np.int64],  # [n]
            modes: Union[str, Sequence[str]] = RECOMPUTE) -> float:
    """Preempts these requests: each one's mode (`modes`: one for all, or one per
    request) takes its KV off the device, and it counts a preemption. The caller
    moves them between the queues. Returns the seconds the moves cost."""
    if isinstance(modes, str):
        seconds = _mode(modes).evict(memory, ids)
    else:
        if len(modes) != ids.size:
            raise ValueError(f"preemption: {len(modes)} modes for {ids.size} victims")
        names = np.asarray(modes)
        seconds = sum(_mode(name).evict(memory, ids[names == name])
                      for name in sorted(set(modes)))
    memory.table.num_preemptions[ids] += 1
    return seconds
