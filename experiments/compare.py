"""Compares policies on one identical workload: `python -m experiments.compare`.

Each policy runs on the same requests (built once from the seed), the same
engine and the same bucket set; results go to one subfolder per policy (named
by its label, `--policies=LABEL=SPEC`, by default the policy's name) under
--out_dir, with a table (comparison.txt, comparison.json; the terminal gets its
key columns) and, with matplotlib installed, a figure (comparison.png). Every
policy, knob and the router are checked before the first run. The table says
what the comparison holds equal and what it does not: each policy's KV
reservation mode (`kv_reservation`) and whether host time was counted on the
clock (`count_host_time`), its effective `token_budget` and `batch_cap` (its own
knob or the scheduler's limit, whichever is lower) and whether prefix caching
was active (`prefix_caching`) (`orca_jax.runner.settings`; each run's config.json
has them under `settings`). Lines above the table (and fields of every
comparison.json row: `identical_compiled_steps`, `unequal_settings`,
`arrival_bound`) say:

* `identical compiled steps: yes/no` on the jax engine: the same compiled
  programs (`compiled_fingerprints.*` of every summary) and every policy's token
  budget reaching the same buckets; `n/a` on the simulator, which compiles
  nothing (`orca_jax.results.comparison`);
* a warning when a setting that changes results (token budget, batch cap, prefix
  caching) differs between policies, offering every fix: the flags that hold it equal
  (`equalizing_flags`: `--max_num_tokens` or `--max_num_seqs` at the lowest value,
  `--prefix_caching=on` or `off`), or `--allow_unequal=token_budget,...`, which says
  the difference is intended and turns the warning into a note;
* which runs were arrival-bound: served requests within 5% of the rate they came
  at (`served_req_s` against `offered_req_s`) with the waiting queue empty after
  half the steps or more (`num_waiting_p50`), whatever the engine's busy fraction,
  so their throughput is the offered load's, not the policy's capacity (the table
  says `throughput = offered load`; `orca_jax.results.comparison.arrival_bound`);
* on the simulator, each policy's padding and its output tok/s and TTFT p50
  against its own run priced ragged (`--step_padding=ragged`: the pilots that
  fitted the ladder are those runs; without pilots each policy runs again, ragged),
  then `ranking unchanged without padding: yes`, or a warning naming the pairs whose
  order changed (comparison.json: `ragged_output_tok_s`, `ragged_ttft_p50_s`, ...).

Lines under the table count each run's rejected and unfinished requests with their
reasons (`comparison.left_out_line`): the columns count finished requests only.

Setups, not only policies: `--variants=LABEL:key=value;key=value,LABEL2:...`
(`experiments.variant_flags`) runs every policy of `--policies` under every
variant, each the command's own flags with those flags set otherwise (keys are the
run flags' names: `router`, `num_replicas`, `prefill_replicas`, `decode_replicas`,
`bucket_ladder`, `step_padding`, `max_num_tokens`, ...; `LABEL:` alone is the
command's own setup). Three routers:

    python -m experiments.compare --engine=sim --policies=vllm --num_replicas=2 \\
      --variants=rr:router=round_robin,lo:router=least_outstanding,ca:router=cache_aware

colocated 2 against disaggregated 1+1 (quoted: `;` separates one variant's settings):

    python -m experiments.compare --engine=sim --policies=vllm \\
      --variants='co:num_replicas=2,dis:prefill_replicas=1;decode_replicas=1'

or the same setups from a JSON file, where a value may hold `,` and `;` (a
`--router_opts` of several knobs); the file's errors name it, the variant and the
key, and `--variants` with `--variants_file` is refused:

    echo '{"co": {"num_replicas": 2}, "dis": {"prefill_replicas": 1,
           "decode_replicas": 1}}' > variants.json
    python -m experiments.compare --engine=sim --policies=vllm --variants_file=variants.json

`sweep` takes the same two flags and sweeps every policy under every variant.

A row is `POLICY@VARIANT` (comparison.json also has a `variant` field; it is the
`policy` of each summary.json) and its folder OUT_DIR/VARIANT/POLICY. Every
variant runs on the one workload the command's flags build (a key that would
change it is refused), and every variant, whatever cluster, router or engine
settings it sets, compiles the one ladder fitted by the pilots (one per policy) of the
command's own setup: so that variants differ by what they set, not by a ladder each fitted to
itself (on the jax engine, the same compiled steps). Only a variant that sets its
own ladder or token budget runs other sizes (a note says so; a fit:K of its own
gets pilots of its own). Every variant is resolved and its policies and router checked
before anything runs; a bad key or value is one line naming the variant and the
key, exit status 2, nothing written.

A wall-clock comparison (`--engine=jax --clock=wall`) measures a machine that
drifts (clocks, heat, neighbours' jobs), so `--repeats=N` runs every policy N
times on the same engine, in alternating order (A B, B A, A B, ...), so that
drift falls on every policy alike. Each repeat's results go to
POLICY/repeat_K (K = 0..N-1); the table and comparison.json give each metric's
median over the repeats and its spread (min–max). On a deterministic clock (the
simulator, or the profiled clock, without --count_host_time) the repeats are
identical but for the measured host time; they still run, as a check.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import textwrap
from typing import Any, Optional, Sequence

from experiments.process_exit import imports_uncollected, without_final_collection

with imports_uncollected(freeze=__name__ == "__main__"):
    from absl import app, flags

    from experiments import flags as run_flags
    from experiments import policy_flags, variant_flags
    from experiments.policy_flags import LabeledPolicy, resolve_policies
    from experiments.terminal_table import WIDTH, fit_table
    from orca_jax.core.api.policy import resolve_policy_class
    from orca_jax.core.json_files import to_json_value, write_json_atomic, write_text_atomic
    from orca_jax.results import comparison
    from orca_jax.results.folder_lock import run_lock
    from orca_jax.results.metrics import format_table
    from orca_jax.results.plots import add_caption, pyplot
    from orca_jax.results.run_folder import check_writable_dir
    from orca_jax.runner.bucket_pilot import (
        RAGGED_FIELDS,
        BucketFit,
        PilotPolicy,
        token_sizes,
    )
    from orca_jax.runner.build import (
        build_engine,
        build_workload,
        scheduler_config,
        workload_line,
    )
    from orca_jax.runner.experiment import run_policy
    from orca_jax.runner.figure_caption import figure_caption
    from orca_jax.runner.leap_hint import leap_hint
    from orca_jax.runner.settings import RESULT_SETTINGS, SETTINGS
    from orca_jax.runner.spec import JaxEngineSpec, RunSpec, SimEngineSpec

flags.adopt_module_key_flags(run_flags)
flags.adopt_module_key_flags(policy_flags)
flags.adopt_module_key_flags(variant_flags)
flags.DEFINE_integer("repeats", 1, "Runs of each policy on the same engine, in alternating order "
                     "(A B, B A, A B, ...); with N > 1 the table gives each metric's median and "
                     "min-max over them, and each run is kept in POLICY/repeat_K. For wall-clock "
                     "comparisons (--engine=jax --clock=wall).", lower_bound=1)
flags.DEFINE_list("allow_unequal", [], "Settings that may differ between the compared "
                  f"policies without a warning (any of {','.join(RESULT_SETTINGS)}): e.g. "
                  "token_budget to compare sarathi's 512-token chunks with vllm's 2048 on "
                  "purpose. The table still shows each policy's value.")

# The comparison's fairness columns come right after the policy's name: each policy's
# effective settings, then whether its run was arrival-bound.
FAIRNESS_COLUMNS = (*SETTINGS, "engine_busy_fraction", "arrival_bound")
# The figure's panels: the terminal table's key figures (`terminal_table.KEY_COLUMNS`), at
# the same percentiles, so the picture and the table say the same.
PLOT_METRICS = (("output_tok_s", "output tokens/s"), ("ttft_p99_s", "TTFT p99 (s)"),
                ("tpot_p99_s", "TPOT p99 (s)"), ("latency_p99_s", "latency p99 (s)"))
# A bar of the figure only when an SLO is set (the summaries then have it).
SLO_PLOT_METRICS = (("goodput_req_s", "goodput (requests/s within SLO)"),)


def plotted_metrics(rows: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """The figure's panels: `PLOT_METRICS`, and goodput where the runs had an SLO."""
    return [*PLOT_METRICS, *((key, label) for key, label in SLO_PLOT_METRICS
                             if any(row.get(key) is not None for row in rows))]


def run_orders(names: Sequence[str], repeats: int) -> list[list[str]]:
    """The order of the policies in each repeat: as given, then reversed, alternately."""
    return [list(names) if k % 2 == 0 else list(reversed(names)) for k in range(repeats)]


def deterministic_clock(spec: RunSpec) -> str | None:
    """What makes the run's clock deterministic ('the simulator', 'the profiled clock'), or
    None when it measures time (the wall clock, or host time counted)."""
    if spec.limits.count_host_time:
        return None
    if isinstance(spec.engine, JaxEngineSpec):
        return "the profiled clock" if spec.engine.clock == "profiled" else None
    return "the simulator"


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def over_repeats(summaries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One summary of N repeats: each number's median, with its min and max in `spread`.

    A field that is not a number in every repeat is kept if every repeat has the
    same value, and left out otherwise (each repeat's summary.json has it).
    """
    row: dict[str, Any] = {}
    spread: dict[str, dict[str, float]] = {}
    for key in summaries[0]:
        values = [summary.get(key) for summary in summaries]
        if all(_is_number(v) for v in values):
            row[key] = statistics.median(values)
            spread[key] = {"min": min(values), "max": max(values)}
        elif all(v == values[0] for v in values):
            row[key] = values[0]
    row["num_repeats"] = len(summaries)
    row["spread"] = spread
    return row


def flat_row(row: dict[str, Any]) -> dict[str, Any]:
    """A comparison.json row: flat, each metric's spread over repeats as `KEY_min` and
    `KEY_max` beside its median (`pandas.json_normalize` reads it as it is)."""
    flat = {key: value for key, value in row.items() if key != "spread"}
    for key, spread in row.get("spread", {}).items():
        flat[f"{key}_min"], flat[f"{key}_max"] = spread["min"], spread["max"]
    return flat


def _number(value: float) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _cell(value: Any, spread: dict[str, float] | None) -> Any:
    """A metric over repeats as `median (min–max)`; one value where the repeats agree."""
    if spread is None or spread["min"] == spread["max"]:
        return value
    return f"{_number(value)} ({_number(spread['min'])}–{_number(spread['max'])})"


# What the table says of an arrival-bound row (comparison.json keeps the bool).
ARRIVAL_BOUND_CELL = {True: "throughput = offered load", False: "no"}


def table_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows as the table prints them (see `_cell`; `arrival_bound` as
    `ARRIVAL_BOUND_CELL` says it)."""
    return [{key: ARRIVAL_BOUND_CELL.get(value, value) if key == "arrival_bound"
             else _cell(value, row.get("spread", {}).get(key)) for key, value in row.items()}
            for row in rows]


def _plot(rows: list[dict], path: str, caption: str) -> Any:
    """The figure (one bar panel per metric, whiskers min–max over repeats), titled with
    the policies and captioned with what ran; the closed Figure, or None without
    matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    panels = plotted_metrics(rows)
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    names = [row["policy"] for row in rows]
    for ax, (key, label) in zip(axes, panels):
        heights = [row.get(key) or 0.0 for row in rows]
        # Over repeats: a bar's whisker spans the repeats' min to max.
        ranges = [row.get("spread", {}).get(key) for row in rows]
        errors = ([[h - (r or {}).get("min", h) for h, r in zip(heights, ranges)],
                   [(r or {}).get("max", h) - h for h, r in zip(heights, ranges)]]
                  if any(ranges) else None)
        ax.bar(names, heights, yerr=errors, color="tab:blue", capsize=4)
        ax.set_title(label, fontsize=10)
        ax.tick_params(axis="x", rotation=30)
    repeats = rows[0].get("num_repeats", 1) if rows else 1
    fig.suptitle(f"compare: {', '.join(names)}"
                 + (f" (median of {repeats} repeats; whiskers min–max)" if repeats > 1 else ""),
                 fontsize=11)
    fig.tight_layout()
    add_caption(fig, caption)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return fig


def compared_line(entries: Sequence[LabeledPolicy], spec: RunSpec) -> str:
    """The terminal's first line: what is compared, on what (the policies; the workload,
    its load and lengths; the engine, its model and hardware; the limits), as the
    figure's caption says it."""
    limits = spec.limits
    return (f"compare {' vs '.join(entry.label for entry in entries)}: "
            f"{figure_caption(spec)}; batch cap {limits.max_num_seqs}, "
            f"{limits.max_num_tokens} tokens a step")


def more_load(spec: RunSpec) -> str:
    """How to offer the command's workload more load: --rate (a trace: rescaled to that
    mean rate), or for a trace replayed at its own times, --trace_time_scale too."""
    if spec.workload.arrival in ("trace", "program_trace") and not spec.workload.trace_at_rate:
        return ("give a higher --rate (the trace rescaled to that mean rate) or lower "
                "--trace_time_scale (0.5 replays it at twice its rate)")
    return "raise --rate"


def equalizing_flags(unequal: dict[str, dict[str, Any]], entries: Sequence[LabeledPolicy]
                     ) -> dict[str, list[str]]:
    """The run flags that would hold each unequal setting equal for every policy (the
    warning's fixes): the scheduler's limit at the lowest effective value caps every
    policy's own knob to it; prefix caching on or off for the whole run (only off where a
    compared policy cannot plan with shared pages, which `on` would refuse)."""
    fixes: dict[str, list[str]] = {}
    for name, flag in (("token_budget", "max_num_tokens"), ("batch_cap", "max_num_seqs")):
        if name in unequal:
            fixes[name] = [f"--{flag}={min(unequal[name].values())}"]
    if "prefix_caching" in unequal:
        refused = any(resolve_policy_class(entry.spec).prefix_caching_unsupported
                      for entry in entries)
        fixes["prefix_caching"] = ["--prefix_caching=off"] if refused else [
            "--prefix_caching=on", "--prefix_caching=off"]
    return fixes


def said_equal(rows: Sequence[dict[str, Any]], settings: dict[str, dict[str, Any]],
               allowed: Sequence[str], spec: RunSpec,
               entries: Sequence[LabeledPolicy] = ()) -> tuple[str, list[str]]:
    """What the comparison held equal: the compiled-steps verdict (`yes`, `no`, `n/a`) and
    the lines printed above the table (that verdict, a warning on unequal settings with
    the flags that would hold them equal, the arrival-bound runs)."""
    verdict, line = comparison.compiled_steps(
        rows, {label: values["token_budget"] for label, values in settings.items()})
    unequal = comparison.unequal_settings(settings, RESULT_SETTINGS)
    lines = [line, *comparison.settings_lines(unequal, allowed,
                                              fixes=equalizing_flags(unequal, entries))]
    bound = comparison.arrival_bound_line(rows, more_load(spec))
    return verdict, lines + ([bound] if bound else [])


def ragged_figures(spec: RunSpec, runs: dict[str, tuple[variant_flags.Setup,
                                                         Optional[BucketFit], LabeledPolicy]],
                   requests: Sequence[Any]) -> dict[str, dict[str, Any]]:
    """Each row's figures priced ragged (`--step_padding=ragged`), to rank the policies
    without padding: its policy's pilot's, where the ladder was fitted to a pilot of its
    very setup (a pilot is priced ragged), else a ragged run of its own. None for a row
    whose padding costs nothing or is measured: already ragged, a fixed step time, a cost
    fit, or the jax engine."""
    figures = {}
    for label, (setup, fit, entry) in runs.items():
        engine = setup.spec.engine
        if (not isinstance(engine, SimEngineSpec) or engine.step_padding == "ragged"
                or engine.step_time_ms is not None or engine.cost_fit is not None):
            continue
        pilot = (fit.ragged(entry.label)
                 if fit is not None and variant_flags.pilot_played(spec, setup) else None)
        if pilot is None:
            ragged = dataclasses.replace(setup.spec, engine=dataclasses.replace(
                engine, step_padding="ragged"))
            summary, _ = run_policy(ragged, entry.spec, entry.options, requests=list(requests),
                                    progress=False, label=label)
            pilot = {key: summary.get(key) for key in RAGGED_FIELDS}
        figures[label] = dict(pilot)
    return figures


@run_flags.clean_errors()
def main(argv: list[str]) -> None:
    del argv
    # Each variant checked as resolved, on its own settings (not the command's alone).
    spec, setups = variant_flags.command_setups()
    entries = resolve_policies(list(run_flags.FLAGS.policies), run_flags.FLAGS.policy_opts)
    out, fresh = run_flags.results_folder("compare")
    # Every policy and the router of every setup are built and checked before anything
    # runs (a typo in the last policy's knob fails now, not after the others ran, and
    # leaves no folder); each one's KV reservation mode (a class attribute or a knob) is
    # read off it.
    settings = variant_flags.check_setups(setups, entries)
    check_writable_dir(out)  # before anything runs; each policy's folder is staged (run_folder)
    allowed = list(run_flags.FLAGS.allow_unequal)
    unknown = [name for name in allowed if name not in RESULT_SETTINGS]
    if unknown:
        raise app.UsageError(f"--allow_unequal={','.join(allowed)}: {', '.join(unknown)} is "
                             f"not one of {', '.join(RESULT_SETTINGS)}")
    # One writer at a time into the folder; it is created by the first policy's run, once
    # the workload (a trace that does not load) and the engine have passed their checks.
    try:
        with run_lock(out, kind="compare"):
            _compare(spec, setups, entries, settings, allowed)
    finally:
        run_flags.link_latest(out, fresh)


def _compare(spec: RunSpec, setups: Sequence[variant_flags.Setup],
             entries: Sequence[LabeledPolicy],
             settings: dict[str, dict[str, Any]], allowed: Sequence[str]) -> None:
    """`main` once every check has passed and it holds the folder's lock."""
    repeats = run_flags.FLAGS.repeats
    out = run_flags.FLAGS.out_dir
    print(textwrap.fill(compared_line(entries, spec), WIDTH, subsequent_indent="  ",
                        break_on_hyphens=False))
    # One workload for every setup: a variant may not set what builds it (variant_flags).
    requests = build_workload(spec)
    print(workload_line(spec, requests))
    # One ladder for every policy, fitted (fit:K) to the pilots of all of them, so that no
    # policy pays for steps only another runs.
    fitted = variant_flags.fit_setups(spec, setups, requests, [
        PilotPolicy(entry.label, entry.spec, entry.options) for entry in entries])
    # Each row: (its label, its setup, how its ladder was fitted, its policy).
    runs = {setup.row_label(entry.label): (setup, fit, entry)
            for setup, fit in fitted for entry in entries}
    labels = list(runs)
    # One engine for every policy of a setup: the very same compiled steps (and the same KV
    # cache buffers) serve each of them. A cluster builds its replicas' own, per run.
    engines = {setup.variant: build_engine(setup.spec, scheduler_config(setup.spec))
               for setup, _ in fitted
               if setup.spec.cluster.num_replicas == 1 and not setup.spec.cluster.disaggregated}
    clocks = [deterministic_clock(setup.spec) for setup, _ in fitted]
    clock = None if None in clocks else clocks[0]
    if repeats > 1 and clock is not None:
        print(f"--repeats={repeats} on a deterministic clock ({clock}): the repeats will be "
              "identical but for the measured host time")
    summaries: dict[str, list[dict[str, Any]]] = {label: [] for label in labels}
    left_out: dict[str, Optional[str]] = {}  # each run's rejected and unfinished, why
    for k, order in enumerate(run_orders(labels, repeats)):
        if repeats > 1:
            print(f"repeat {k}: {', '.join(order)}")
        for label in order:
            setup, fit, entry = runs[label]
            folder = setup.folder(out, entry.label)
            summary, result = run_policy(setup.spec, entry.spec, entry.options,
                                         out_dir=os.path.join(folder, f"repeat_{k}")
                                         if repeats > 1 else folder,
                                         requests=requests, engine=engines.get(setup.variant),
                                         label=label, bucket_fit=fit)
            summaries[label].append(summary)
            left_out.setdefault(label, comparison.left_out_line(label, result))
    rows = [summaries[label][0] if repeats == 1 else over_repeats(summaries[label])
            for label in labels]
    rows = [{**row, "policy": label,
             **({} if runs[label][0].variant is None else {"variant": runs[label][0].variant})}
            for row, label in zip(rows, labels)]
    verdict, lines = said_equal(rows, settings, allowed, spec, entries)
    lines += variant_flags.ladder_lines([setup for setup, _ in fitted])
    ragged = ragged_figures(spec, runs, requests)
    lines += comparison.padding_lines({row["policy"]: row for row in rows}, ragged)
    rows = [{**row, **settings[row["policy"]],
             **{f"ragged_{key}": value
                for key, value in ragged.get(row["policy"], {}).items()},
             "arrival_bound": comparison.arrival_bound(row),
             "identical_compiled_steps": verdict,
             "unequal_settings": ",".join(comparison.unequal_settings(settings,
                                                                      RESULT_SETTINGS)),
             "num_buckets": len(token_sizes(runs[row["policy"]][0].spec))} for row in rows]
    columns = [run_flags.TABLE_COLUMNS[0], *FAIRNESS_COLUMNS, *run_flags.TABLE_COLUMNS[1:],
               *[c for c in run_flags.QOE_COLUMNS if any(c in row for row in rows)]]
    table = format_table(table_rows(rows), columns)
    shown = fit_table(table_rows(rows))
    if repeats > 1:
        note = (f"{repeats} repeats per policy, in alternating order; each metric: median "
                f"(min–max), or one value where every repeat agrees\n")
        table, shown = note + table, note + shown
    below = "\n".join(line for line in left_out.values() if line)
    if below:  # under the table: the requests its columns do not count, and why
        table, shown = f"{table.rstrip()}\n{below}", f"{shown.rstrip()}\n{below}"
    table = "".join(line + "\n" for line in lines) + table
    # The terminal keeps 120 columns: each line wrapped, its continuation indented.
    print("".join(textwrap.fill(line, WIDTH, subsequent_indent="  ", break_on_hyphens=False)
                  + "\n" for line in lines) + shown)
    hints = {leap_hint(setup.spec, entry.spec) for setup, _, entry in runs.values()}
    for hint in sorted(hint for hint in hints if hint):  # a plugin planned step by step
        print(hint)
    write_text_atomic(os.path.join(out, "comparison.txt"), table + "\n")
    print(f"every column: {os.path.join(out, 'comparison.txt')}")
    write_json_atomic(os.path.join(out, "comparison.json"),
                      to_json_value([flat_row(row) for row in rows]), sort_keys=False)
    if _plot(rows, os.path.join(out, "comparison.png"),
             figure_caption(spec, repeats=repeats)
             + variant_flags.caption_note(spec, setups)):
        print(f"figure: {os.path.join(out, 'comparison.png')}")
    print(f"results in {out}")


if __name__ == "__main__":
    run_flags.run_command(without_final_collection(main))
