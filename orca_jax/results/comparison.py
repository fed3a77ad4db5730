"""What a comparison held equal between its policies, and what it did not.

Reads the runs' summaries (and each policy's effective settings,
`orca_jax.runner.settings`) and says, in lines a reader cannot miss:

* `identical compiled steps`: on the jax engine, yes when every policy's
  summary holds the same compiled programs (`compiled_fingerprints.T`, the HLO
  fingerprint of the step of T tokens) *and* every policy's token budget
  reaches the same of them. A policy whose budget is below the largest bucket
  never runs the programs above its budget's bucket, so it ran other steps than
  the rest: no. On the simulator nothing is compiled: n/a (the simulator prices
  every policy's steps on the same bucket sizes; `num_buckets` says how many).
* unequal settings: a warning line naming each result-changing setting
  (`RESULT_SETTINGS`) that differs between policies, with each policy's value,
  unless the user allowed that setting's difference.
* arrival-bound runs (`arrival_bound`): a policy that served the requests as fast
  as they came, with short queues; its throughput is the offered load, not its
  capacity, whatever its engine's busy fraction.
* what padding decided (`padding_lines`): each policy's padding and its figures
  against its figures priced ragged (no padding), and whether the ranking holds
  without padding.
* requests left out: a run's rejected and unfinished requests, counted with their
  reasons (`left_out_line`), since the table's columns count finished requests only
  and 10 of 50 requests over the context used to vanish from it without a line.
"""

from __future__ import annotations

import collections
import re
from typing import Any, Collection, Mapping, Optional, Sequence

from orca_jax.core.requests.request import RequestState
from orca_jax.core.requests.run_result import RunResult

FINGERPRINT_PREFIX = "compiled_fingerprints."
# A run is arrival-bound when it served requests at least this share of the rate they came
# at (`served_req_s` over `offered_req_s`: within 5%) ...
ARRIVAL_BOUND_SERVED = 0.95
# ... and its queue stayed short: empty after at least half of its steps (`num_waiting_p50`
# below 1), so the policy admitted everyone waiting at least every other step and had
# capacity to spare. An engine at capacity keeps a queue, and one past it a growing one. A
# busy fraction says nothing here: a continuous-batching engine is busy whenever anything
# decodes (issue 50: orca and vllm at 81% busy printed the offered load alike).
SHORT_QUEUE = 1.0  # requests waiting after the median step: fewer is short
# Ranking by these metrics, with and without padding (`padding_lines`): name, whether
# higher is better, and how the line names it.
RANK_METRICS = (("output_tok_s", True, "output tok/s"), ("ttft_p50_s", False, "TTFT p50"))
# Two policies whose figures differ by at most this share of the larger tie: a ranking
# that changes inside it (or by less than it) is noise, not a verdict.
RANK_TIE = 0.02


def compiled_fingerprints(summary: Mapping[str, Any]) -> dict[int, str]:
    """A run's compiled programs, bucket tokens -> HLO fingerprint (empty on the simulator)."""
    return {int(key[len(FINGERPRINT_PREFIX):]): value for key, value in summary.items()
            if key.startswith(FINGERPRINT_PREFIX)}


def reached_buckets(sizes: Sequence[int], token_budget: int) -> list[int]:
    """The bucket sizes a step of at most `token_budget` tokens can run at: every size up
    to the smallest that holds the budget (all of them if none does)."""
    ordered = sorted(sizes)
    holding = [size for size in ordered if size >= token_budget]
    top = holding[0] if holding else (ordered[-1] if ordered else 0)
    return [size for size in ordered if size <= top]


def _span(sizes: Sequence[int]) -> str:
    return f"{sizes[0]}-{sizes[-1]} tokens" if len(sizes) > 1 else f"{sizes[0]} tokens"


def compiled_steps(rows: Sequence[Mapping[str, Any]],
                   budgets: Mapping[str, int]) -> tuple[str, str]:
    """Whether every policy ran identical compiled steps.

    Args:
      rows: one summary per policy, each with its `policy` label and `engine`.
      budgets: each label's effective token budget.

    Returns:
      (`yes`, `no` or `n/a`, the line compare prints:
      `identical compiled steps: ...` with the reason).
    """
    prints = {row["policy"]: compiled_fingerprints(row) for row in rows}
    if not any(prints.values()):
        engines = sorted({str(row.get("engine")) for row in rows})
        engine = "simulator" if engines == ["sim"] else f"engine {', '.join(engines)}"
        return "n/a", (f"identical compiled steps: n/a ({engine}: nothing is compiled; every "
                       "policy's steps run on the same bucket sizes)")
    first = next(iter(prints))
    differing = [label for label, fps in prints.items() if fps != prints[first]]
    if differing:
        return "no", (f"identical compiled steps: no: the compiled programs of "
                      f"{', '.join(differing)} differ from {first}'s (compiled_fingerprints.*)")
    sizes = sorted(prints[first])
    reached = {label: reached_buckets(sizes, budgets[label]) for label in prints}
    if len({tuple(r) for r in reached.values()}) > 1:
        groups: dict[tuple[int, ...], list[str]] = {}
        for label, r in reached.items():
            groups.setdefault(tuple(r), []).append(label)
        parts = [f"{', '.join(group)} run{'s' if len(group) == 1 else ''} buckets of "
                 f"{_span(r)} (token budget {', '.join(sorted({str(budgets[g]) for g in group}))})"
                 for r, group in groups.items()]
        return "no", ("identical compiled steps: no: the same programs are compiled, but "
                      + "; ".join(parts))
    return "yes", (f"identical compiled steps: yes ({len(sizes)} buckets of {_span(sizes)}, "
                   "the same HLO fingerprints for every policy)")


def unequal_settings(settings: Mapping[str, Mapping[str, Any]],
                     names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The settings among `names` whose value differs between policies: name -> (label ->
    value), in `names`' order."""
    found = {}
    for name in names:
        values = {label: values[name] for label, values in settings.items()}
        if len({repr(v) for v in values.values()}) > 1:
            found[name] = values
    return found


def settings_lines(unequal: Mapping[str, Mapping[str, Any]], allowed: Collection[str],
                   flag: str = "--allow_unequal",
                   fixes: Optional[Mapping[str, Sequence[str]]] = None) -> list[str]:
    """The warning (and the note, for the differences `allowed`) on unequal settings.

    Args:
      unequal: setting -> (label -> value), as `unequal_settings` gives them.
      allowed: the settings whose difference is intended (a note, not a warning).
      flag: the flag that allows a difference.
      fixes: setting -> the flags (alternatives) that would hold it equal for every
        policy; the warning offers them before `flag`.
    """
    def describe(names: Sequence[str]) -> str:
        return "; ".join(f"{name} (" + ", ".join(f"{label}={_value(v)}" for label, v in
                                                 unequal[name].items()) + ")"
                         for name in names)
    warned = [name for name in unequal if name not in allowed]
    noted = [name for name in unequal if name in allowed]
    lines = []
    if warned:
        equal = [f"{' or '.join(fixes[name])} ({name})" for name in warned
                 if fixes and fixes.get(name)]
        hold = f"to hold them equal pass {', '.join(equal)}; or, " if equal else ""
        lines.append(f"warning: settings that change results differ between policies: "
                     f"{describe(warned)}; {hold}if intended, pass {flag}={','.join(warned)}")
    if noted:
        lines.append(f"unequal settings, allowed by {flag}: {describe(noted)}")
    return lines


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def arrival_bound(summary: Mapping[str, Any]) -> bool:
    """Whether a run is arrival-bound: it served requests within 5% of the rate they came
    at (`ARRIVAL_BOUND_SERVED`) and its waiting queue stayed short (`SHORT_QUEUE`), so its
    throughput is the offered load's, not the policy's capacity.

    Args:
      summary: the run's summary.json (`offered_req_s`, `served_req_s`,
        `num_waiting_p50`).
    """
    offered, served = summary.get("offered_req_s"), summary.get("served_req_s")
    waiting = summary.get("num_waiting_p50")
    if not offered or served is None or waiting is None:
        return False
    return served >= ARRIVAL_BOUND_SERVED * offered and waiting < SHORT_QUEUE


def arrival_bound_line(rows: Sequence[Mapping[str, Any]], more_load: str = "raise --rate"
                       ) -> Optional[str]:
    """The line naming the arrival-bound policies (None if there are none).

    Args:
      rows: the runs' summaries, each with its `policy` label.
      more_load: how to offer this workload more load (`--rate` does nothing to a trace).
    """
    bound = [f"{row['policy']} ({row['served_req_s']:.3g} of {row['offered_req_s']:.3g} req/s)"
             for row in rows if arrival_bound(row)]
    if not bound:
        return None
    return (f"arrival-bound (served within {1 - ARRIVAL_BOUND_SERVED:.0%} of the offered rate, "
            f"the queue empty after half the steps or more): {', '.join(bound)}: "
            f"throughput = offered load, not capacity; {more_load} to compare capacity")


def _order(a: float, b: float, higher: bool) -> int:
    """1 if `a` is better than `b` by more than `RANK_TIE` of the larger, -1 if worse, else
    0 (a tie)."""
    if abs(a - b) <= RANK_TIE * max(abs(a), abs(b)):
        return 0
    return 1 if (a > b) == higher else -1


def _gap(a: float, b: float) -> float:
    top = max(abs(a), abs(b))
    return (a - b) / top if top else 0.0


def ranking_changes(padded: Mapping[str, Mapping[str, Any]],
                    ragged: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The pairs whose order by a `RANK_METRICS` metric differs with and without padding.

    A pair's order is better, worse or a tie (`RANK_TIE`); it changed when the order
    differs and the two figures' relative gap moved by more than `RANK_TIE` (so two
    policies at the edge of a tie do not flip on noise).

    Args:
      padded: label -> its run's summary (priced with padding).
      ragged: label -> its figures priced ragged; labels missing here are left out.

    Returns:
      One phrase per changed pair, e.g. `orca over sarathi by TTFT p50 (2.1x better with
      padding, 1.01x without)`.
    """
    labels = [label for label in padded if label in ragged]
    changes = []
    for key, higher, name in RANK_METRICS:
        for i, a in enumerate(labels):
            for b in labels[i + 1:]:
                values = [(padded[a].get(key), padded[b].get(key)),
                          (ragged[a].get(key), ragged[b].get(key))]
                if any(v is None for pair in values for v in pair):
                    continue
                (pa, pb), (ra, rb) = values
                if (_order(pa, pb, higher) == _order(ra, rb, higher)
                        or abs(_gap(pa, pb) - _gap(ra, rb)) <= RANK_TIE):
                    continue
                first, second = (a, b) if _order(pa, pb, higher) >= 0 else (b, a)
                changes.append(f"{first} vs {second} by {name} "
                               f"({_said(padded, first, second, key)} with padding, "
                               f"{_said(ragged, first, second, key)} without)")
    return changes


def _said(figures: Mapping[str, Mapping[str, Any]], a: str, b: str, key: str) -> str:
    return f"{figures[a][key]:.4g} against {figures[b][key]:.4g}"


def padding_lines(padded: Mapping[str, Mapping[str, Any]],
                  ragged: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """What padding did to a comparison: each policy's padding fraction with its output
    tok/s and TTFT p50 against its own ragged figures, and the ranking verdict
    (`ranking unchanged without padding: yes`, or a warning naming the pairs that
    changed, `ranking_changes`). No lines without ragged figures.

    Args:
      padded: label -> its run's summary.
      ragged: label -> its figures priced ragged (`output_tok_s`, `ttft_p50_s`).
    """
    if not ragged:
        return []
    costs = []
    for label, row in padded.items():
        if label not in ragged:
            continue
        tok, ragged_tok = row.get("output_tok_s"), ragged[label].get("output_tok_s")
        ttft, ragged_ttft = row.get("ttft_p50_s"), ragged[label].get("ttft_p50_s")
        parts = [f"{row.get('padding_fraction', 0.0):.1%} of step tokens"]
        if tok is not None and ragged_tok:
            parts.append(f"output tok/s {tok / ragged_tok - 1:+.1%}")
        if ttft is not None and ragged_ttft:
            parts.append(f"TTFT p50 {ttft / ragged_ttft:.2f}x")
        costs.append(f"{label} {', '.join(parts)}")
    lines = ["padding (against each policy's run priced ragged, --step_padding=ragged): "
             + "; ".join(costs)]
    changes = ranking_changes(padded, ragged)
    if changes:
        lines.append("warning: the ranking depends on padding: " + "; ".join(changes)
                     + " (each policy's run priced ragged: comparison.json's ragged_*)")
    else:
        lines.append("ranking unchanged without padding: yes")
    return lines



# Reasons shown per run: the most common kinds (a reason's text with its numbers taken out).
MAX_REASONS = 3


def left_out_line(label: str, result: RunResult) -> Optional[str]:
    """One line on the requests of `result` that did not finish, or None when all did:
    how many were rejected and why (each kind of reason with its count and one example,
    most common first), and how many were left unfinished when the run ended.

    Example: `orca: 10 of 50 requests rejected (10 like "prompt 4107 + output 50 tokens
    exceed the context of 1024"), 0 unfinished`.
    """
    state = result.state
    rejected = [i for i in range(len(state)) if state[i] == RequestState.REJECTED]
    unfinished = int(((state != RequestState.FINISHED)
                      & (state != RequestState.REJECTED)).sum())
    if not rejected and not unfinished:
        return None
    kinds: collections.Counter[str] = collections.Counter()
    example: dict[str, str] = {}
    for i in rejected:
        reason = result.reject_reason[i] or "no reason given"
        kind = re.sub(r"\d+(\.\d+)?", "#", reason)
        kinds[kind] += 1
        example.setdefault(kind, reason)
    common = kinds.most_common(MAX_REASONS)
    shown = [f'{count} like "{example[kind]}"' for kind, count in common]
    others = len(rejected) - sum(count for _, count in common)
    if others:
        shown.append(f"{others} for other reasons (requests.jsonl's reason)")
    why = f" ({'; '.join(shown)})" if shown else ""
    ended = " (the run ended before they did)" if unfinished else ""
    return (f"{label}: {len(rejected)} of {len(state)} requests rejected{why}, {unfinished} "
            f"unfinished{ended}")

