"""The canonical pictures: latency against throughput over a sweep, and the slot timeline.

matplotlib is imported inside the drawing functions only, so `orca_jax`
imports without it; `slot_timeline` (the numbers behind the timeline picture)
needs no matplotlib at all.

The slot timeline: the scheduler logs no per-step request ids, so
`slot_timeline` drives a fresh scheduler itself, one `Scheduler.step()` at a
time, and reads the request table around each step through public attributes.
A request ran in a step when its computed-token count grew (or, if the step
preempted it, when it is above zero again: it was readmitted in the same step).
It *holds* a slot while it runs, while it is admitted but idle (`running`), and,
for policies that return answers late (static batching's `defer_release`),
until it is released (`unreleased`). Slots are given lowest-free-first, in
arrival order, and a request keeps its slot until it lets go of it.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.request import RequestState
from orca_jax.core.scheduler import Scheduler
from orca_jax.results.sweep_store import Curve

EMPTY = -1  # holder value of an empty slot

METRIC_LABELS = {
    "normalized_latency_mean_s": "mean normalized latency (s/token)",
    "ttft_p99_s": "TTFT p99 (s)",
    "tpot_p99_s": "TPOT p99 (s)",
    "throughput_req_s": "throughput (requests/s)",
    "throughput_tok_s": "throughput (output tokens/s)",
    "normalized_latency_p50_s": "median normalized latency (s/token)",
    "itl_p99_s": "p99 time between tokens (s)",
    "offered_rate_req_s": "offered load (requests/s)",
}


def _pyplot():
    """matplotlib's pyplot on the file-only backend, or None when not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


# ---------------------------------------------------------------- sweep figure
def plot_sweep(curves: Sequence[Curve], path: str, *, x_field: str, y_field: str,
               title: Optional[str] = None, band_label: str = "min–max over seeds") -> bool:
    """Draws latency against throughput: one line per policy, a band over seeds.

    Args:
      curves: `sweep_store.aggregate(...)` output.
      path: the PNG to write.
      x_field, y_field: the summary fields the curves hold (for the axis labels).
      title: the figure's title.
      band_label: what the shaded band is, for the legend's note.

    Returns:
      False when matplotlib is not installed (nothing written), else True.
    """
    plt = _pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for index, curve in enumerate(curves):
        if curve.rates.size == 0:
            continue
        color = f"C{index % 10}"
        ax.plot(curve.x_mean, curve.y_mean, marker="o", color=color, label=curve.policy)
        ax.fill_between(curve.x_mean, curve.y_low, curve.y_high, color=color, alpha=0.2,
                        linewidth=0)
    ax.set_xlabel(METRIC_LABELS.get(x_field, x_field))
    ax.set_ylabel(METRIC_LABELS.get(y_field, y_field))
    ax.set_title(title or f"{METRIC_LABELS.get(y_field, y_field)} against load", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(title=f"mean; band: {band_label}", fontsize=8, title_fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ---------------------------------------------------------------- slot timeline
@dataclasses.dataclass(frozen=True)
class SlotTimeline:
    """Which request holds which batch slot at each step of one run.

    Attributes:
      policy: the policy's name.
      holder: `[num_steps, num_slots]` request index in each slot, `EMPTY` when free.
      computing: `[num_steps, num_slots]` whether the holder computed tokens
        in that step (False: it held the slot idle, e.g. finished and waiting
        for its batch).
      request_ids: `Request.id` of each request index.
    """

    policy: str
    holder: NDArray[np.int64]  # [num_steps, num_slots]
    computing: NDArray[np.bool_]  # [num_steps, num_slots]
    request_ids: tuple[int, ...]

    @property
    def num_steps(self) -> int:
        return int(self.holder.shape[0])

    @property
    def num_slots(self) -> int:
        return int(self.holder.shape[1])

    def request_id_at(self, step: int, slot: int) -> Optional[int]:
        """The id of the request holding `slot` at `step`, None when the slot is empty."""
        index = int(self.holder[step, slot])
        return None if index == EMPTY else self.request_ids[index]


def slot_timeline(scheduler: Scheduler) -> SlotTimeline:
    """Runs a fresh scheduler to the end, recording the slot each request holds per step.

    Args:
      scheduler: a scheduler that has not stepped yet (it is run to completion here).

    Returns:
      The run's slot timeline; `scheduler` is left finished, as after `run()`.

    Raises:
      ValueError: the scheduler has already stepped (its per-step ids are lost).
    """
    if scheduler.num_steps or scheduler.done:
        raise ValueError(f"slot_timeline needs a fresh scheduler; this one has run "
                         f"{scheduler.num_steps} steps (the scheduler does not log who ran)")
    table = scheduler.table
    scheduler.engine.warmup(scheduler.bucket_config.buckets())
    slot_of: dict[int, int] = {}
    rows: list[tuple[dict[int, int], set[int]]] = []
    while not scheduler.done:
        computed = table.num_computed.copy()  # [N]
        preemptions = table.num_preemptions.copy()  # [N]
        steps_before = scheduler.num_steps
        scheduler.step()
        if scheduler.num_steps == steps_before:
            continue  # an idle iteration (a release, a jump to the next arrival): no step
        after = table.num_computed
        preempted = table.num_preemptions != preemptions
        ran = set(np.flatnonzero(np.where(preempted, after > 0, after > computed)).tolist())
        held = (ran | set(np.flatnonzero(table.state == RequestState.RUNNING).tolist())
                | set(scheduler.unreleased.tolist()))
        slot_of = {r: s for r, s in slot_of.items() if r in held}
        taken = set(slot_of.values())
        free = (s for s in range(len(table) + 1) if s not in taken)
        for request in sorted(held - slot_of.keys()):
            slot_of[request] = next(free)
        rows.append((dict(slot_of), ran))
    num_slots = max([scheduler.config.max_batch_size]
                    + [max(slots.values()) + 1 for slots, _ in rows if slots])
    holder = np.full((len(rows), num_slots), EMPTY, dtype=np.int64)
    computing = np.zeros((len(rows), num_slots), dtype=bool)
    for step, (slots, ran) in enumerate(rows):
        for request, slot in slots.items():
            holder[step, slot] = request
            computing[step, slot] = request in ran
    return SlotTimeline(policy=scheduler.policy.name, holder=holder, computing=computing,
                        request_ids=tuple(int(spec.id) for spec in table.specs))


def _segments(timeline: SlotTimeline, slot: int) -> list[tuple[int, int, int, bool]]:
    """`(start_step, num_steps, request_index, computing)` runs of one slot's row."""
    segments: list[tuple[int, int, int, bool]] = []
    for step in range(timeline.num_steps):
        request = int(timeline.holder[step, slot])
        if request == EMPTY:
            continue
        busy = bool(timeline.computing[step, slot])
        if segments and segments[-1][2] == request and segments[-1][3] == busy \
                and segments[-1][0] + segments[-1][1] == step:
            start, length, _, _ = segments[-1]
            segments[-1] = (start, length + 1, request, busy)
        else:
            segments.append((step, 1, request, busy))
    return segments


def plot_slot_timelines(timelines: Sequence[SlotTimeline], path: str,
                        titles: Optional[Sequence[str]] = None) -> bool:
    """Draws slot timelines stacked top to bottom on one step axis.

    Each request is a colored bar labeled with its id in the slot it holds;
    steps where it holds the slot without computing (finished, waiting for the
    rest of its static batch) are hatched and pale.

    Args:
      timelines: e.g. static and continuous batching on the same requests.
      path: the PNG to write.
      titles: one per timeline (default: the policy names).

    Returns:
      False when matplotlib is not installed (nothing written), else True.
    """
    plt = _pyplot()
    if plt is None:
        return False
    titles = list(titles) if titles is not None else [t.policy for t in timelines]
    if len(titles) != len(timelines):
        raise ValueError(f"got {len(titles)} titles for {len(timelines)} timelines")
    max_steps = max(t.num_steps for t in timelines)
    fig, axes = plt.subplots(len(timelines), 1, squeeze=False, sharex=True,
                             figsize=(max(6.0, 0.32 * max_steps + 1.5),
                                      sum(0.45 * t.num_slots + 0.9 for t in timelines)))
    cmap = plt.get_cmap("tab20")
    for ax, timeline, title in zip(axes[:, 0], timelines, titles):
        for slot in range(timeline.num_slots):
            for start, length, request, busy in _segments(timeline, slot):
                color = cmap(request % 20)
                ax.broken_barh([(start, length)], (slot - 0.4, 0.8), facecolors=color,
                               alpha=1.0 if busy else 0.3, hatch=None if busy else "//",
                               edgecolor="white" if busy else "grey", linewidth=0.8)
                if busy:
                    ax.text(start + length / 2, slot, str(timeline.request_ids[request]),
                            ha="center", va="center", fontsize=8)
        ax.set_ylim(timeline.num_slots - 0.5, -0.5)  # slot 0 on top
        ax.set_yticks(range(timeline.num_slots))
        ax.set_ylabel("slot")
        ax.set_title(f"{title}: {timeline.num_steps} steps", fontsize=10, loc="left")
        ax.set_xlim(0, max_steps)
        ax.grid(True, axis="x", alpha=0.25)
    axes[-1, 0].set_xlabel("step (hatched: slot held by a finished request)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_slot_timeline(scheduler: Scheduler, path: str, title: Optional[str] = None
                       ) -> Optional[SlotTimeline]:
    """Runs a fresh scheduler and draws its slot timeline (one panel).

    Args:
      scheduler: a scheduler that has not stepped yet (run to completion here).
      path: the PNG to write.
      title: the panel's title (default: the policy name).

    Returns:
      The timeline; None if matplotlib is not installed (the scheduler still ran).
    """
    timeline = slot_timeline(scheduler)
    drawn = plot_slot_timelines([timeline], path, [title or timeline.policy])
    return timeline if drawn else None
