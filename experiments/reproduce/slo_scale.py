"""DistServe's SLO-scale reading: at a fixed rate, how tight an SLO a system still meets.

DistServe (OSDI'24, its SLO-scale figures) multiplies both the TTFT and the TPOT
SLO by one factor, the SLO scale, and plots the share of requests that meet both
against it at a fixed request rate; "12.6x tighter SLO" compares the tightest
scale at which each system still reaches 90% attainment. A run does not depend on
its SLO, so one run per system gives the whole curve: request i meets the SLOs
scaled by s exactly when s >= its own needed scale

    need_i = max(ttft_i / TTFT_SLO, tpot_i / TPOT_SLO)

(TPOT left out for a one-token output, as `orca_jax.results.metrics.run_summary`
counts it; infinite for a request that did not finish), so the attainment at s is
the share of `need_i <= s`, and the tightest scale at 90% is an order statistic
of `need`, no grid needed. The grid (`SCALES`) is for the table and the figure.
"""

from __future__ import annotations

import math
import os
from typing import Optional, Sequence

import numpy as np
from numpy.typing import NDArray

from orca_jax.core.requests.run_result import RunResult
from orca_jax.results import metrics

# The scales of the table and the figure: 0.1x to 20x the base SLOs, in steps of
# about 1.25x (the tightest scale itself is exact, not read off this grid).
SCALES = (0.1, 0.125, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.25, 1.5, 2.0, 2.5,
          3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.5, 15.0, 20.0)


def needed_scales(result: RunResult, ttft_slo_s: float, tpot_slo_s: float
                  ) -> NDArray[np.float64]:
    """`[N]` the smallest SLO scale each request meets (inf: it never finished)."""
    per_request = metrics.request_metrics(result.arrival_s, result.first_scheduled_s,
                                          result.first_token_s, result.finish_s,
                                          result.output_len, result.token_req,
                                          result.token_time_s, token_stats=result.token_stats)
    finished = np.isfinite(np.asarray(result.finish_s, np.float64))
    tpot = np.nan_to_num(per_request["tpot_s"], nan=0.0)  # a one-token output meets any TPOT
    need = np.maximum(per_request["ttft_s"] / ttft_slo_s, tpot / tpot_slo_s)
    return np.where(finished, need, np.inf)


def attainment(need: NDArray[np.float64],  # [N] needed scales
               scale: float) -> float:
    """The share of requests that meet both SLOs scaled by `scale`."""
    return float(np.mean(need <= scale)) if need.size else math.nan


def tightest_scale(need: NDArray[np.float64],  # [N] needed scales
                   target: float) -> Optional[float]:
    """The smallest scale at which at least `target` of the requests meet both SLOs
    (None: fewer than that ever finish)."""
    if need.size == 0:
        return None
    k = math.ceil(target * need.size - 1e-9)  # requests that must meet it
    value = float(np.sort(need)[max(k, 1) - 1])
    return value if math.isfinite(value) else None


def ratio(baseline: Optional[float], value: Optional[float]) -> Optional[float]:
    """How many times tighter `value` is than `baseline` (None where either is missing)."""
    if baseline is None or value is None or value <= 0:
        return None
    return baseline / value


def plot(curves: Sequence[dict], path: str, *, title: str, caption: str, cols: int = 2
         ) -> bool:
    """Attainment against SLO scale, one panel per distinct `panel` of the curves, `cols`
    panels a row.

    Args:
      curves: dicts with `panel` (its title), `label`, `disaggregated` and `need`
        (`[N]` needed scales).
      path: the PNG to write.
      title: the figure's title; caption: the line under it.
      cols: panels per row.

    Returns:
      False without matplotlib.
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = list(dict.fromkeys(c["panel"] for c in curves))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, squeeze=False, figsize=(5.2 * cols, 3.0 * rows))
    # Draw only where some curve moves: from just below the smallest needed scale to just
    # above the largest 99th percentile of one (within SCALES' range).
    finite = [c["need"][np.isfinite(c["need"])] for c in curves]
    finite = [f for f in finite if f.size]
    low = max(SCALES[0], 0.8 * min((float(f.min()) for f in finite), default=SCALES[0]))
    high = min(SCALES[-1], 1.25 * max((float(np.quantile(f, 0.99)) for f in finite),
                                      default=SCALES[-1]))
    grid = np.geomspace(low, max(high, 1.01 * low), 400)
    for ax, panel in zip(axes.flat, panels):
        for curve in (c for c in curves if c["panel"] == panel):
            ax.plot(grid, [attainment(curve["need"], s) for s in grid],
                    linestyle="--" if curve["disaggregated"] else "-", label=curve["label"])
        ax.axhline(0.9, color="grey", linewidth=0.8, linestyle=":")
        ax.set_xscale("log")
        ax.invert_xaxis()  # tighter to the right, as DistServe draws it
        ax.set_title(panel, fontsize=9)
        ax.set_xlabel("SLO scale (both SLOs x scale; tighter ->)")
        ax.set_ylabel("SLO attainment")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=10)
    fig.text(0.5, 0.005, caption, ha="center", fontsize=7)
    fig.tight_layout(rect=(0, 0.03, 1, 0.96))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


if __name__ == "__main__":  # a helper module: `--help` says so, not nothing
    from experiments.cli_errors import not_a_command
    not_a_command('experiments.reproduce.slo_scale',
                  "the DistServe reproduction's SLO-scale curves",
                  'python -m experiments.reproduce.distserve --help')
