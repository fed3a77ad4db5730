"""The canonical pictures: latency against throughput over a sweep, and the slot timeline.

matplotlib is imported inside the drawing functions only, so `orca_jax`
imports without it; `slot_timeline` (the numbers behind the timeline picture)
needs no matplotlib at all.

The slot timeline reads a finished run's step logs (`RunResult.step_requests`
and `step_held`, kept when the run had `SchedulerConfig.features.log_step_requests`): a
request ran in a step when the step computed tokens of it, and it *holds* a slot
while it runs, while it is admitted but idle (running), and, for policies that
return answers late (static batching's `defer_release`), until it is released.
Slots are given lowest-free-first, in arrival order, and a request keeps its
slot until it lets go of it.
"""

from __future__ import annotations

import dataclasses
import textwrap
from typing import Any, Optional, Sequence

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.requests.run_result import RunResult
from orca_jax.results.sweep_store import Curve

EMPTY = -1  # holder value of an empty slot

METRIC_LABELS = {
    "normalized_latency_mean_s": "mean normalized latency (s/token)",
    "ttft_p99_s": "TTFT p99 (s)",
    "tpot_p99_s": "TPOT p99 (s)",
    "throughput_req_s": "throughput (requests/s)",
    "throughput_tok_s": "throughput (output tokens/s)",
    "output_tok_s": "throughput (output tokens/s)",
    "total_tok_s": "throughput (prompt + output tokens/s)",
    "normalized_latency_p50_s": "median normalized latency (s/token)",
    "itl_p99_s": "p99 time between tokens (s)",
    "offered_rate_req_s": "offered load (requests/s)",
    "offered_rate_programs_s": "offered load (programs/s)",
    "program_completion_mean_s": "mean program completion time (s)",
    "goodput_req_s": "goodput (requests/s within SLO)",
    "slo_attainment": "SLO attainment (share of requests)",
}


def pyplot():
    """matplotlib's pyplot on the file-only backend, or None when not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


# ---------------------------------------------------------------- sweep figure
def add_caption(fig: Any, caption: Optional[str]) -> None:
    """Writes `caption` (what was run: `runner.figure_caption`) in small type along the
    figure's foot, below its axes, wrapped to the figure's width."""
    if not caption:
        return
    width = fig.get_size_inches()[0]
    text = textwrap.fill(caption, width=max(40, int(width * 15)))
    lines = text.count("\n") + 1
    fig.text(0.01, 0.01, text, fontsize=7, ha="left", va="bottom", color="0.3")
    fig.tight_layout(rect=(0, 0.035 * lines + 0.01, 1, 1))


def plot_sweep(curves: Sequence[Curve], path: str, *, x_field: str, y_field: str,
               title: Optional[str] = None, band_label: str = "min–max over seeds",
               caption: Optional[str] = None, x_label: Optional[str] = None) -> Any:
    """Draws latency against throughput: one line per policy (per `POLICY@VARIANT` under
    variants), a band over seeds.

    A curve's band is drawn only where a point has more than one seed to spread over,
    and the legend names the band only when one is drawn (one seed: no band, no note).

    Args:
      curves: `sweep_store.aggregate(...)` output.
      path: the PNG to write.
      x_field, y_field: the summary fields the curves hold (for the axis labels).
      title: the figure's title.
      band_label: what the shaded band is, for the legend's note.
      caption: a line under the axes saying what was run (`runner.figure_caption`).
      x_label: the x axis's label where `x_field`'s usual one would mislead (a sweep
        over conversations/s, not requests/s); None: `x_field`'s.

    Returns:
      None when matplotlib is not installed (nothing written), else the (closed)
      matplotlib Figure written, whose texts a caller or a test may read.
    """
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    banded = False
    for index, curve in enumerate(curves):
        if curve.rates.size == 0:
            continue
        color = f"C{index % 10}"
        ax.plot(curve.x_mean, curve.y_mean, marker="o", color=color, label=curve.label)
        if np.any(curve.num_seeds > 1):  # one seed spreads over nothing: no band
            ax.fill_between(curve.x_mean, curve.y_low, curve.y_high, color=color, alpha=0.2,
                            linewidth=0)
            banded = True
    ax.set_xlabel(x_label or METRIC_LABELS.get(x_field, x_field))
    ax.set_ylabel(METRIC_LABELS.get(y_field, y_field))
    ax.set_title(title or f"{METRIC_LABELS.get(y_field, y_field)} against load", fontsize=10)
    ax.grid(True, alpha=0.3)
    if banded:
        ax.legend(title=f"mean; band: {band_label}", fontsize=8, title_fontsize=8)
    else:
        ax.legend(fontsize=8)
    fig.tight_layout()
    add_caption(fig, caption)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return fig


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


def slot_timeline(result: RunResult, *, num_slots: Optional[int] = None) -> SlotTimeline:
    """The slot each request holds at each step of a finished run.

    Args:
      result: a run with `SchedulerConfig.features.log_step_requests` (its steps' requests).
      num_slots: the rows of the timeline (the run's batch cap, say); default and
        at least: the most slots held at once.

    Returns:
      The run's slot timeline.

    Raises:
      ValueError: the run did not log its steps' requests, or it is a cluster's
        (each replica has its own slots).
    """
    if result.num_replicas > 1:
        raise ValueError(f"slot_timeline draws one scheduler's slots; this run has "
                         f"{result.num_replicas} replicas")
    if result.step_requests is None or result.step_held is None:
        raise ValueError("slot_timeline needs a run with "
                         "SchedulerConfig.features.log_step_requests (the requests of each "
                         "step); this one did not log them")
    slot_of: dict[int, int] = {}
    rows: list[tuple[dict[int, int], set[int]]] = []
    for requests, held_after in zip(result.step_requests, result.step_held):
        ran = set(requests.tolist())
        held = ran | set(held_after.tolist())
        slot_of = {r: s for r, s in slot_of.items() if r in held}
        taken = set(slot_of.values())
        free = (s for s in range(result.num_requests + 1) if s not in taken)
        for request in sorted(held - slot_of.keys()):
            slot_of[request] = next(free)
        rows.append((dict(slot_of), ran))
    num_slots = max([num_slots or 0] + [max(slots.values()) + 1 for slots, _ in rows if slots])
    holder = np.full((len(rows), num_slots), EMPTY, dtype=np.int64)
    computing = np.zeros((len(rows), num_slots), dtype=bool)
    for step, (slots, ran) in enumerate(rows):
        for request, slot in slots.items():
            holder[step, slot] = request
            computing[step, slot] = request in ran
    return SlotTimeline(policy=result.policy, holder=holder, computing=computing,
                        request_ids=tuple(int(i) for i in result.request_ids))


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
    plt = pyplot()
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


def plot_slot_timeline(result: RunResult, path: str, title: Optional[str] = None, *,
                       num_slots: Optional[int] = None) -> Optional[SlotTimeline]:
    """Draws a finished run's slot timeline (one panel).

    Args:
      result: a run with `SchedulerConfig.features.log_step_requests`.
      path: the PNG to write.
      title: the panel's title (default: the policy name).
      num_slots: the rows to draw (see `slot_timeline`).

    Returns:
      The timeline; None if matplotlib is not installed (nothing written).
    """
    timeline = slot_timeline(result, num_slots=num_slots)
    drawn = plot_slot_timelines([timeline], path, [title or timeline.policy])
    return timeline if drawn else None
