"""Preemption: what happens to a victim's KV. Modes are registered by name.

A policy names the mode of each victim (`Policy.preemption_modes`); the core
preempts with `preempt`, the one preemption function: the mode takes the
victims' KV off the device and the request counts a preemption. The core also
calls it when requests received with their KV wait while their pages block
every admission (they recompute, as if preempted). Built in: `recompute`
(vLLM v1's, the default): the pages are freed and the request computes its
context again when readmitted; and `swap` (vLLM v0's `preemption_mode=swap`):
the pages move to the host tier over its link and come back over it when the
request is readmitted, which resumes where it was (a victim the host tier has
no room for recomputes). `preemption_costs` says what each would cost, for a
policy choosing per victim. A plugin adds a mode with `register_preemption_mode`.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Protocol, Sequence, Union

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.kv.lower_tiers import PageTier, swap_tier
from orca_jax.core.kv.memory import KVMemory

RECOMPUTE = "recompute"
SWAP = "swap"


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


class Swap:
    """The victims' pages move to the host tier (the step waits for the copy); each comes
    back over the link when readmitted and resumes where it was. Victims the host tier
    has no room for recompute."""

    def evict(self, memory: KVMemory, ids: NDArray[np.int64]) -> float:  # [n]
        tier = swap_tier(memory.tiers)
        if tier is None:
            raise ValueError("preemption mode 'swap' needs a host KV tier (--kv_host_gb or "
                             "--kv_host_pages)")
        held = memory.pool.num_held[ids]
        room = memory.tiers.tiers[tier].capacity_pages - memory.tiers.num_used(tier)
        fits = np.cumsum(held) <= room  # [n] the first victims, while the tier has room
        seconds = 0.0
        if fits.any():
            seconds = memory.tiers.move_away(ids[fits], memory.pool, tier)
            memory.pool.free(ids[fits])  # num_computed stays: nothing is computed again
        if not fits.all():
            seconds += Recompute().evict(memory, ids[~fits])
        return seconds


_MODES: dict[str, PreemptionMode] = {RECOMPUTE: Recompute(), SWAP: Swap()}
BUILT_IN = (RECOMPUTE, SWAP)


class PreemptionCosts(NamedTuple):
    """What preempting each request would cost, by mode (`preemption_costs`).

    Swap moves `pages` down the host link and, when the request is readmitted, back up
    it; recompute moves nothing and computes `recompute_tokens` again (their prefill
    time is the engine's: a policy weighs them against the link seconds).
    """

    pages: NDArray[np.int64]  # [n] device pages it holds (freed either way)
    swap_out_s: NDArray[np.float64]  # [n] link seconds of its swap out (inf: no host tier)
    swap_in_s: NDArray[np.float64]  # [n] link seconds of its swap back in (inf: no host)
    recompute_tokens: NDArray[np.int64]  # [n] tokens recompute computes again
    swap_fits: NDArray[np.bool_]  # [n] the host tier has room for its pages now (alone)

    @property
    def swap_s(self) -> NDArray[np.float64]:  # [n]
        """Link seconds of a swap out and back in."""
        return self.swap_out_s + self.swap_in_s


def preemption_costs(memory: KVMemory, ids: NDArray[np.int64]) -> PreemptionCosts:  # [n]
    """Each request's cost under `swap` and `recompute`: a swap's link seconds out and
    back in, unqueued (the links' queues add to them), whether the host tier has room
    for it, and recompute's tokens. Reads only."""
    ids = np.asarray(ids, dtype=np.int64)
    pages = memory.pool.num_held[ids].astype(np.int64)
    tier = swap_tier(memory.tiers)
    if tier is None:
        out_s = in_s = np.full(ids.size, math.inf)
        fits = np.zeros(ids.size, dtype=np.bool_)
    else:
        host = memory.tiers.tiers[tier]
        assert isinstance(host, PageTier)
        num_bytes = pages * host.page_bytes  # [n]
        out_s = host.link.down.latency_s + num_bytes / host.link.down.bytes_per_s
        in_s = host.link.up.latency_s + num_bytes / host.link.up.bytes_per_s
        fits = pages <= host.capacity_pages - memory.tiers.num_used(tier)
    return PreemptionCosts(pages, out_s.astype(np.float64), in_s.astype(np.float64),
                           memory.table.num_computed[ids].astype(np.int64), fits)


def register_preemption_mode(name: str, mode: PreemptionMode) -> None:
    """Makes `mode` available under `name` (a policy names it per victim)."""
    if name in _MODES:
        raise ValueError(f"preemption mode {name!r} is already registered")
    _MODES[name] = mode


def unregister_preemption_mode(name: str) -> None:
    """Removes a mode a plugin registered (the built-in ones stay)."""
    if name in BUILT_IN or name not in _MODES:
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
