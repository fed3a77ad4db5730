"""KV pinned across a program's tool pauses (docs/programs.md; Continuum's idea).

When a call of an agent program finishes, its KV pages may stay on the device for
its program's next call instead of being freed: the policy says for how long
(`Policy.kv_pin_s`). A pinned page is held, so it counts against the pool; the
next call finds it through the prefix cache as any hit (a call's prompt holds
its parent's prompt and answer), and once a child is admitted over them the pin
ends (the child holds what it shares). A pin also ends when its time runs out
(the scheduler's next-event time counts it, so a leap stops there), and every
pin ends when an iteration would otherwise run nothing while requests wait
(pinned pages never block the run).

Only with prefix caching active (without it no later call can find the pages)
and on one replica. Nothing here runs without programs.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
from numpy.typing import NDArray

# A `Scheduler` (which imports this module: it is not named here, to keep imports acyclic).
Scheduler = Any


def pin_finished(scheduler: Scheduler, finished: NDArray[np.int64],  # [f]
                 end_s: float) -> Optional[NDArray[np.bool_]]:  # -> [f]
    """Pins the finished calls the policy keeps; returns which of `finished` keep their
    pages (None: none do)."""
    book = scheduler.table.programs
    if book is None or not scheduler.prefix_caching:
        return None
    parents = book.has_children[finished]
    if not parents.any():
        return None
    rows = finished[parents]
    seconds = np.broadcast_to(np.asarray(scheduler.policy.kv_pin_s(scheduler.view, rows),
                                         dtype=np.float64), rows.shape)
    pinned = seconds > 0
    if not pinned.any():
        return None
    held = scheduler.kv.num_held
    for row, pin_s in zip(rows[pinned].tolist(), seconds[pinned].tolist()):
        book.pin(row, end_s, end_s + pin_s, int(held[row]))
    keep = np.zeros(finished.size, dtype=bool)
    keep[np.flatnonzero(parents)[pinned]] = True
    return keep


def unpin(scheduler: Scheduler, rows: list[int], *, hit: bool) -> None:
    """Ends these pins now and frees their pages (cached pages stay cached, evictable)."""
    book = scheduler.table.programs
    assert book is not None
    for row in rows:
        book.unpin(row, scheduler.now_s, hit)
    scheduler.kv.free(np.asarray(rows, dtype=np.int64))


def unpin_admitted_parents(scheduler: Scheduler, admitted: NDArray[np.int64]) -> None:  # [a]
    """Calls just admitted (their hits shared) end their parents' pins."""
    book = scheduler.table.programs
    assert book is not None
    parents = book.pinned_parents(admitted)
    if parents:
        unpin(scheduler, parents, hit=True)


def expire(scheduler: Scheduler) -> None:
    """Ends the pins whose time has run out."""
    book = scheduler.table.programs
    assert book is not None
    due = sorted(row for row, until in book.pins.items() if until <= scheduler.now_s)
    if due:
        unpin(scheduler, due, hit=False)


def release_all(scheduler: Scheduler) -> bool:
    """Ends every pin (the run would otherwise stall on them). Returns whether any was."""
    book = scheduler.table.programs
    if book is None or not book.pins:
        return False
    unpin(scheduler, sorted(book.pins), hit=False)
    return True
