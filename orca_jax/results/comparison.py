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
* arrival-bound runs: a policy whose engine was busy less than
  `ARRIVAL_BOUND_BUSY` of the run waited for requests most of the time; its
  throughput is the offered load's, not its capacity.
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
# Below this engine busy fraction a run is flagged arrival-bound: its engine idled more
# than half the run, so every policy that keeps up prints the offered load's throughput
# (the Azure code trace at 37% busy printed 52.7 tok/s for every policy).
ARRIVAL_BOUND_BUSY = 0.5


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
                   flag: str = "--allow_unequal") -> list[str]:
    """The warning (and the note, for the differences `allowed`) on unequal settings."""
    def describe(names: Sequence[str]) -> str:
        return "; ".join(f"{name} (" + ", ".join(f"{label}={_value(v)}" for label, v in
                                                 unequal[name].items()) + ")"
                         for name in names)
    warned = [name for name in unequal if name not in allowed]
    noted = [name for name in unequal if name in allowed]
    lines = []
    if warned:
        lines.append(f"warning: settings that change results differ between policies: "
                     f"{describe(warned)}; if intended, pass {flag}={','.join(warned)}")
    if noted:
        lines.append(f"unequal settings, allowed by {flag}: {describe(noted)}")
    return lines


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def arrival_bound(busy: Optional[float]) -> bool:
    """Whether a run whose engine was busy `busy` of its duration is arrival-bound."""
    return busy is not None and busy < ARRIVAL_BOUND_BUSY


def arrival_bound_line(busy: Mapping[str, Optional[float]]) -> Optional[str]:
    """The line naming the arrival-bound policies (None if there are none)."""
    bound = [f"{label} ({value:.0%} busy)" for label, value in busy.items()
             if value is not None and arrival_bound(value)]
    if not bound:
        return None
    return (f"arrival-bound (engine busy < {ARRIVAL_BOUND_BUSY:.0%} of the run): "
            f"{', '.join(bound)}: their throughput is the offered load's, not their "
            "capacity; raise --rate to compare capacity")


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
