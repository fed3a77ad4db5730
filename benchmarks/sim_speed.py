"""How fast the simulator runs: requests and steps simulated per second of process time.

    python -m benchmarks.sim_speed > benchmarks/results/sim_speed.txt
    python -m benchmarks.sim_speed --old_rev 74740d2 --rounds 3   # beside an old revision

Each case is one `python -m experiments.run --engine=sim --policy=vllm --model=llama3-8b
--hardware=a100 --bucket_ladder=pow2` process on Poisson arrivals at 30 req/s per replica
(with N replicas the rate is 30 N, round robin), timed by the child's own process time
(`resource`'s `RUSAGE_CHILDREN`: imports, workload, the run and writing its results).

`--bucket_ladder` is pinned (pow2 by default) so that a case is one simulation: the
simulator's default `auto` ladder (`fit:16`) first simulates the whole workload once more,
the pilot run it fits the step sizes to (`orca_jax.runner.bucket_pilot`);
`--bucket_ladder=auto` measures the command as it runs by default, pilot included.

With `--issue_trace`, it measures leaping (`orca_jax.core.loop.leap`) on issue 34's
trace shape instead: 10,000 Poisson requests at each of `--rates` (30 and 15 req/s),
prompts of 300 tokens, outputs of 100, `--policy=vllm` with a batch cap of 256 and a
4,096-token budget, each rate run with `--leap` and `--noleap` (alternating which goes
first from round to round), and prints each run's process time per request, its steps
and the fraction of them run inside leaps, with the leaps that began after finishes and
after prefills, the chances the policy refused or the back-off let go and the leaps
that ran past arrivals (the run's log line, `leap.leap_counts`; a revision before them
logs the leaps alone), then the medians:

    python -m benchmarks.sim_speed --issue_trace --rounds 3 > benchmarks/results/sim_speed_leap.txt
    python -m benchmarks.sim_speed --issue_trace --old_rev 21242e9 --rounds 3   # and before leaping
    python -m benchmarks.sim_speed --issue_trace --old_rev 1f4a4bd --old_noleap  # both --noleap

With `--floor` (and `--issue_trace`), each round also times what no tree can go below:
the interpreter with numpy and absl's flags imported and nothing else (`FLOOR_COMMAND`;
Python, numpy and absl are fixed by design), and this tree's run of one request (its own
start-up: imports, an empty workload, the files; with `--old_rev`, the old tree's run of
one request too, "oldone"), each as process time per request of the trace. The old
tree's time over the floor's is then the most any tree could be faster than it, as
measured here, however little its loop cost. Once per rate it also times the results'
text alone (`text_floor_s`): this tree's run's requests.jsonl and steps.jsonl made again
from their values with one `%` template a row, the cheapest way Python writes them
(checked byte for byte); the floor plus that text is what a tree that writes its
results whole pays before it imports or simulates anything:

    python -m benchmarks.sim_speed --issue_trace --old_rev 21242e9 --floor --rounds 3

With `--profile`, it runs one case of the issue's trace (the first of `--rates`) under
cProfile in a child process and prints where its time goes, phase by phase (`PHASES`:
the imports, the workload, the policy's plan, the plan checks, admission, KV
allocation and freeing, packing, pricing, the update, token counts, the leaps, the
streamed logs and the finished run's files), each as cProfile's inclusive seconds and
as a share of the whole process. cProfile adds a fixed cost to every Python call, so
the shares of call-heavy phases are inflated; compare the phases of one profile, or
two profiles, never a profile with a process time.

With `--planner NAME`, every cluster case (replicas > 1) runs under that planner, from
all its replicas (`--max_replicas` the case's), asked every second of virtual time with
5 s start-ups and SLOs for its metrics (`PLANNER_FLAGS`): what planning adds to a run.

    python -m benchmarks.sim_speed --requests 10000 --replicas 8 --planner threshold

With `--old_rev REV`, every case also runs at revision REV (its files from `git archive`
in a temporary folder): this script's own code runs the same command line with that
tree as the working folder and alone on PYTHONPATH. The command line is the stable
interface here (the library's internals are what a revision changes), so one script
measures both trees. Each round runs both trees, the order alternating from round to
round (`--rounds` rounds; `old_revision.interleaved`), so machine load hits both
alike; the rows are medians over the rounds, and `new/old` is the ratio of the median
process times (below 1: the current tree is faster), summed up by their geometric mean.
The step counts of both trees are compared too: a revision that changes no result
simulates the same steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from benchmarks.old_revision import REPO, interleaved, median_ratio, revision_tree, tree_env

RATE_PER_REPLICA = 30.0
# A cluster case with --planner: from all its replicas, asked every second, 5 s start-ups.
PLANNER_FLAGS = ["--planner_interval_s=1", "--replica_startup_s=5", "--ttft_slo_s=1",
                 "--tpot_slo_s=0.05"]
COLUMNS = (f"{'requests':>9} {'replicas':>8} {'steps':>8} {'process s':>10} {'wall s':>8} "
           f"{'requests/s':>11} {'steps/s':>9} {'us/step':>8}")


@dataclasses.dataclass(frozen=True)
class ChildRun:
    """One child process as `run_child` measured it."""

    stdout: str
    stderr: str
    cpu_s: float  # user + system seconds: the child's and those of what it waited for
    wall_s: float
    peak_mib: float  # the child's own peak resident set


def run_child(command: list[str], cwd: Path, env: dict[str, str], what: str) -> ChildRun:
    """Runs `command` in `cwd` to its end and measures it: its process time is the
    difference of `resource`'s `RUSAGE_CHILDREN` before and after (its imports, its work
    and its files: the figure every case here prints), its peak resident set is the one
    `os.wait4` reports of this child alone (`RUSAGE_CHILDREN`'s is the largest of every
    child so far), which Linux counts from this process's own peak at the spawn: a child
    smaller than its parent reads as the parent. Exits with the end of its stderr, as
    `what` failed, where it fails."""
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        child = subprocess.Popen(command, cwd=cwd, env=env, stdout=stdout, stderr=stderr)
        _, status, usage = os.wait4(child.pid, 0)  # not Popen.wait: its own peak too
        wall_s = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        child.returncode = os.waitstatus_to_exitcode(status)
        stdout.seek(0)
        stderr.seek(0)
        printed, errors = stdout.read(), stderr.read()
    if child.returncode != 0:
        sys.exit(f"{what} failed:\n{errors[-2000:]}")
    return ChildRun(stdout=printed, stderr=errors, wall_s=wall_s,
                    cpu_s=(after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
                    peak_mib=usage.ru_maxrss / 1024)  # Linux: KiB


def run_command(num_requests: int, num_replicas: int, bucket_ladder: str,
                out: str, planner: Optional[str] = None) -> list[str]:
    """The command line of one case (the stable interface both trees are measured by);
    with `planner`, a cluster case runs it (`PLANNER_FLAGS`)."""
    command = [sys.executable, "-m", "experiments.run", "--engine=sim", "--policy=vllm",
               "--model=llama3-8b", "--hardware=a100", f"--num_requests={num_requests}",
               f"--rate={RATE_PER_REPLICA * num_replicas:g}", f"--num_replicas={num_replicas}",
               f"--bucket_ladder={bucket_ladder}", f"--out_dir={out}"]
    if planner is not None and num_replicas > 1:
        command += [f"--planner={planner}", f"--max_replicas={num_replicas}", *PLANNER_FLAGS]
    return command


def run_case(num_requests: int, num_replicas: int, bucket_ladder: str,
             tree: Path = REPO, planner: Optional[str] = None) -> dict:
    """Runs one case in a child process on `tree`'s code; its process time, steps, wall time."""
    env = tree_env(tree, JAX_PLATFORMS="cpu")  # its first call compiles: not this run's time
    with tempfile.TemporaryDirectory() as out:
        run = run_child(run_command(num_requests, num_replicas, bucket_ladder, out, planner),
                        tree, env, f"experiments.run in {tree}")
        num_steps = sum(1 for _ in open(os.path.join(out, "steps.jsonl")))
    found = LEAP_LINE.search(run.stderr)  # a tree that logs its leaps (a cluster's: later)
    return {"requests": num_requests, "replicas": num_replicas, "steps": num_steps,
            "cpu_s": run.cpu_s, "wall_s": run.wall_s,
            "leaped": int(found.group(1)) if found else None}


def format_row(row: dict, label: str = "") -> str:
    """One table line of a case (`label`: the tree, when two are measured)."""
    return (f"{row['requests']:>9} {row['replicas']:>8} {row['steps']:>8} "
            f"{row['cpu_s']:>10.2f} {row['wall_s']:>8.2f} "
            f"{row['requests'] / row['cpu_s']:>11.0f} {row['steps'] / row['cpu_s']:>9.0f} "
            f"{row['cpu_s'] / row['steps'] * 1e6:>8.1f}" + (f"  {label}" if label else "")
            + (f"  leaped {row['leaped'] / row['steps']:.3f} of the steps"
               if row.get("leaped") is not None else ""))


def median_row(rows: list[dict]) -> dict:
    """The rounds of one case as one row: median process and wall seconds."""
    return {**rows[0], "cpu_s": statistics.median(r["cpu_s"] for r in rows),
            "wall_s": statistics.median(r["wall_s"] for r in rows)}


def compare_case(num_requests: int, num_replicas: int, bucket_ladder: str,
                 trees: dict[str, Path], rounds: int) -> float:
    """Prints one case at each tree (medians of `rounds` interleaved runs) and returns
    new/old of the median process times."""
    rows = interleaved(lambda tree: run_case(num_requests, num_replicas, bucket_ladder, tree),
                       trees, rounds)
    (old_label, old_rows), (new_label, new_rows) = rows.items()
    for label, runs in rows.items():
        print(format_row(median_row(runs), label) + "   process s: "
              + " ".join(f"{r['cpu_s']:.2f}" for r in runs), flush=True)
    ratio = median_ratio([r["cpu_s"] for r in new_rows], [r["cpu_s"] for r in old_rows])
    same_steps = {r["steps"] for r in old_rows} == {r["steps"] for r in new_rows}
    print(f"{'':>9} new/old process time {ratio:.3f}; steps "
          f"{'identical' if same_steps else 'DIFFER'}", flush=True)
    return ratio


ISSUE_TRACE = ["--engine=sim", "--policy=vllm", "--model=llama3-8b", "--hardware=a100",
               "--prompt_len=fixed:300", "--output_len=fixed:100", "--max_num_seqs=256",
               "--max_num_tokens=4096", "--policy_opts=max_num_tokens=4096"]
LEAP_LINE = re.compile(r"leaped over (\d+) of (\d+) steps in (\d+) leaps")
# The start-up that no tree can go below (`--floor`): the interpreter with numpy and absl's
# flags imported, which every run of the command line imports, and nothing of the project.
FLOOR_COMMAND = [sys.executable, "-c", "import numpy, absl.app, absl.flags"]
# The rest of the line where a tree logs it (`leap.leap_counts`): the widenings' leaps and
# the chances refused or let go.
LEAP_COUNTS = re.compile(r"\((\d+) after finishes, (\d+) after prefills; chances refused "
                         r"(\d+), let go (\d+)\)(?:, (\d+) of them past arrivals)?")


def trace_command(num_requests: int, rate: float, leap: Optional[bool], bucket_ladder: str,
                  out_dir: str) -> list[str]:
    """The command line of one run of the issue's trace shape (`leap` None: no leap flag,
    the default mode, or a revision from before it), its results in `out_dir`."""
    flag = [] if leap is None else ["--leap" if leap else "--noleap"]
    return [sys.executable, "-m", "experiments.run", *ISSUE_TRACE,
            f"--num_requests={num_requests}", f"--rate={rate:g}",
            f"--bucket_ladder={bucket_ladder}", *flag, f"--out_dir={out_dir}"]


def run_trace_case(num_requests: int, rate: float, leap: Optional[bool], bucket_ladder: str,
                   tree: Path = REPO) -> dict:
    """One run of the issue's trace shape in a child process on `tree`'s code: process
    time, steps, leaps (`leap` None: no leap flag, for a revision from before it)."""
    env = tree_env(tree, JAX_PLATFORMS="cpu")  # its first call compiles: not this run's time
    with tempfile.TemporaryDirectory() as out:
        run = run_child(trace_command(num_requests, rate, leap, bucket_ladder, f"{out}/run"),
                        tree, env, "experiments.run")
        num_steps = sum(1 for _ in open(os.path.join(out, "run", "steps.jsonl")))
    found = LEAP_LINE.search(run.stderr)
    leaped = int(found.group(1)) if found else 0
    counts = LEAP_COUNTS.search(run.stderr)
    return {"rate": rate, "leap": leap, "steps": num_steps, "leaped": leaped,
            "leaps": int(found.group(3)) if found else 0, "cpu_s": run.cpu_s,
            "ms_per_request": run.cpu_s / num_requests * 1e3,
            "counts": (tuple(int(c) for c in counts.groups() if c is not None) if counts
                       else None)}


def row_texts(path: str) -> tuple[str, list[str], list[tuple]]:
    """A JSON-lines file's text, each row's `%` template (one per set of keys, in the
    file's key order) and the values it fills in: ints and finite floats as they are
    (`%d`, `%r`: json writes `repr` of a float), anything else as its JSON text."""
    text = open(path).read()
    templates: dict[tuple, str] = {}
    chosen, values = [], []
    for line in text.splitlines():
        row = json.loads(line)
        cells = tuple(value if type(value) is int
                      or (type(value) is float and math.isfinite(value))
                      else json.dumps(value) for value in row.values())
        shape = (tuple(row), tuple("%d" if type(c) is int else "%r" if type(c) is float
                                   else "%s" for c in cells))
        template = templates.get(shape)
        if template is None:
            template = templates[shape] = "{" + ", ".join(
                f"{json.dumps(key)}: {cell}" for key, cell in zip(*shape)) + "}\n"
        chosen.append(template)
        values.append(cells)
    return text, chosen, values


def text_floor_s(num_requests: int, rate: float, bucket_ladder: str) -> float:
    """The process time of writing one run's results as text and nothing else: this
    tree's run of the trace, whose requests.jsonl and steps.jsonl are then formatted
    again here, each row by one `%` template from values in hand (the cheapest way
    Python makes the text; best of 5, checked byte for byte against the files). Every
    tree writes these files whole, however little its loop costs."""
    with tempfile.TemporaryDirectory() as out:
        run_child(trace_command(num_requests, rate, True, bucket_ladder, f"{out}/run"), REPO,
                  tree_env(REPO, JAX_PLATFORMS="cpu"), "experiments.run")
        files = [row_texts(os.path.join(out, "run", name))
                 for name in ("requests.jsonl", "steps.jsonl")]
    best = float("inf")
    for _ in range(5):
        start = time.process_time()
        texts = ["".join([template % cells for template, cells in zip(chosen, values)])
                 for _, chosen, values in files]
        best = min(best, time.process_time() - start)
    if texts != [text for text, _, _ in files]:
        sys.exit("text floor: the templates did not make the files' bytes")
    return best


def run_floor_case(num_requests: int, rate: float) -> dict:
    """`FLOOR_COMMAND`'s process time in a child process, per request of a trace of
    `num_requests` (a row as `run_trace_case` returns it, with no steps)."""
    cpu_s = run_child(FLOOR_COMMAND, REPO, tree_env(REPO), "the floor's command").cpu_s
    return {"rate": rate, "leap": None, "steps": 0, "leaped": 0, "leaps": 0, "cpu_s": cpu_s,
            "ms_per_request": cpu_s / num_requests * 1e3, "counts": None}


# (label, depth, functions as (path ending, function name)): the phases of a profile;
# depth 1 phases are parts of the depth 0 phase above them.
PHASES = (
    ("process (cProfile's total)", 0, ()),
    ("imports", 1, (("<frozen importlib._bootstrap>", "_find_and_load"),)),
    ("workload", 1, (("orca_jax/runner/build.py", "build_workload"),)),
    ("scheduler built", 1, (("orca_jax/core/loop/scheduler.py", "__init__"),)),
    ("run loop (Scheduler.run)", 1, (("orca_jax/core/loop/scheduler_loop.py", "run"),)),
    ("leaps (Leaper.leap)", 2, (("orca_jax/core/loop/leap.py", "leap"),)),
    ("schedule() in all", 2, (("orca_jax/core/loop/scheduler_loop.py", "schedule"),)),
    ("arrivals join", 3, (("orca_jax/core/loop/scheduler_loop.py", "_admit_arrivals"),)),
    ("policy plan (Policy.schedule)", 3, (("policies/", "schedule"),)),
    ("plan checks", 3, (("orca_jax/core/plans/plan_checks.py", "checked_counts"),)),
    ("admission", 3, (("orca_jax/core/loop/scheduler.py", "_admit"),)),
    ("KV allocation", 3, (("orca_jax/core/kv/pool.py", "allocate"),)),
    ("packing", 3, (("orca_jax/core/step/packing.py", "pack_step"),)),
    ("pricing (engine step)", 2, (("orca_jax/sim/engine.py", "step_packed"),)),
    ("update() in all", 2, (("orca_jax/core/loop/scheduler_loop.py", "update"),)),
    ("token counts and times", 3, (("orca_jax/core/requests/run_record.py", "log_tokens"),)),
    ("finishes (pages freed)", 3, (("orca_jax/core/loop/scheduler_loop.py", "_finish"),)),
    ("step log", 3, (("orca_jax/core/requests/run_record.py", "log_step"),)),
    ("streamed logs", 2, (("orca_jax/runner/live_results.py", "__call__"),)),
    ("summary", 1, (("orca_jax/results/summary.py", "summarize_run"),)),
    ("finished run's files", 1, (("orca_jax/runner/experiment.py", "finish_run_folder"),)),
)


def profile_phases(stats_path: str) -> list[tuple[str, int, float, int]]:
    """`(label, depth, inclusive seconds, calls)` of each of `PHASES` in a cProfile
    file (a phase of several functions sums them; a function named nowhere counts 0)."""
    import pstats
    stats = pstats.Stats(stats_path).stats  # (file, line, name) -> (cc, nc, tt, ct, callers)
    total = max(entry[3] for entry in stats.values())
    rows = []
    for label, depth, functions in PHASES:
        if not functions:
            rows.append((label, depth, total, 1))
            continue
        seconds, calls = 0.0, 0
        for (path, _, name), (_, num_calls, _, cumulative, _) in stats.items():
            if name in [f for ending, f in functions if path.endswith(ending)
                        or (ending.endswith("/") and ending in path)]:
                seconds += cumulative
                calls += num_calls
        rows.append((label, depth, seconds, calls))
    return rows


def profile_case(num_requests: int, rate: float, bucket_ladder: str) -> None:
    """Prints the phases of one profiled run of the issue's trace (see the module doc)."""
    with tempfile.TemporaryDirectory() as out:
        stats_path = os.path.join(out, "run.prof")
        result = subprocess.run(
            [sys.executable, "-m", "cProfile", "-o", stats_path,
             *trace_command(num_requests, rate, None, bucket_ladder, f"{out}/run")[1:]],
            cwd=REPO, env=tree_env(REPO, JAX_PLATFORMS="cpu"), capture_output=True, text=True)
        if result.returncode != 0:
            sys.exit(f"experiments.run failed:\n{result.stderr[-2000:]}")
        num_steps = sum(1 for _ in open(os.path.join(out, "run", "steps.jsonl")))
        rows = profile_phases(stats_path)
    total = rows[0][2]
    print(f"profile of one run at {rate:g} req/s, {num_requests} requests, {num_steps} steps "
          "(cProfile's inclusive seconds; its per-call cost inflates call-heavy phases)")
    print(f"{'phase':<36} {'seconds':>8} {'share':>6} {'calls':>8} {'us/step':>8}")
    for label, depth, seconds, calls in rows:
        print(f"{'  ' * depth + label:<36} {seconds:>8.3f} {seconds / total:>6.1%} "
              f"{calls:>8} {seconds / num_steps * 1e6:>8.1f}", flush=True)


def issue_trace(num_requests: int, rates: list[float], rounds: int, bucket_ladder: str,
                old_tree: Optional[Path] = None, old_noleap: bool = False,
                floor: bool = False) -> None:
    """Leap against no leap on the issue's trace shape, `rounds` interleaved runs each
    (and revision `old_tree`'s run, where given, and with `old_noleap` its `--noleap`
    run too, a revision that has the flag: the modes' order turns each round; with
    `floor`, `FLOOR_COMMAND` and this tree's one-request run too, per request of the
    trace)."""
    print(f"{'rate':>5} {'mode':>7} {'steps':>7} {'leaped':>7} {'leaps':>6} {'process s':>10} "
          f"{'ms/request':>11}  after finishes/prefills, chances refused/let go, past arrivals")
    modes: list[tuple[str, Optional[bool], Path]] = [("leap", True, REPO),
                                                      ("noleap", False, REPO)]
    if old_tree is not None:
        modes.append(("old", None, old_tree))
        if old_noleap:  # the per-step path alone, both trees
            modes.append(("oldnl", False, old_tree))
    # Start-ups (`--floor`): the stack's imports alone, and this tree's run of one request
    # (and the old tree's, where given: what a change to the start-up itself saved).
    start_ups: list[tuple[str, Optional[bool], Path]] = []
    if floor:
        start_ups = [("floor", None, REPO), ("one", True, REPO)]
        if old_tree is not None:
            start_ups.append(("oldone", None, old_tree))
    modes += start_ups
    for rate in rates:
        runs: dict[str, list[dict]] = {label: [] for label, _, _ in modes}
        for round_index in range(rounds):
            turned = modes[round_index % len(modes):] + modes[:round_index % len(modes)]
            for label, leap, tree in (turned if round_index % 2 == 0 else turned[::-1]):
                if label == "floor":
                    row = run_floor_case(num_requests, rate)
                elif label in ("one", "oldone"):  # process time, per request of the trace
                    row = run_trace_case(1, rate, leap, bucket_ladder, tree)
                    row["ms_per_request"] = row["cpu_s"] / num_requests * 1e3
                else:
                    row = run_trace_case(num_requests, rate, leap, bucket_ladder, tree)
                runs[label].append(row)
                counts = ("" if row["counts"] is None or not row["leaps"] else
                          "  {}/{}, {}/{}".format(*row["counts"])
                          + ("" if len(row["counts"]) < 5 else f", {row['counts'][4]}"))
                print(f"{rate:>5g} {label:>7} {row['steps']:>7} "
                      f"{row['leaped']:>7} {row['leaps']:>6} {row['cpu_s']:>10.2f} "
                      f"{row['ms_per_request']:>11.3f}{counts}", flush=True)
        medians = {label: statistics.median(r["ms_per_request"] for r in rows)
                   for label, rows in runs.items()}
        fraction = statistics.median(r["leaped"] / r["steps"] for r in runs["leap"])
        same_steps = len({r["steps"] for label, rows in runs.items() for r in rows
                          if label not in ("floor", "one", "oldone")}) == 1
        print(f"rate {rate:g}: median ms/request leap {medians['leap']:.3f}, noleap "
              f"{medians['noleap']:.3f}, noleap/leap {medians['noleap'] / medians['leap']:.2f}x"
              + (f", old {medians['old']:.3f}, old/leap {medians['old'] / medians['leap']:.2f}x"
                 if "old" in medians else "")
              + (f", old noleap {medians['oldnl']:.3f}, old noleap/noleap "
                 f"{medians['oldnl'] / medians['noleap']:.2f}x" if "oldnl" in medians else "")
              + f"; leaped fraction of steps {fraction:.3f}; steps "
              f"{'identical' if same_steps else 'DIFFER'}", flush=True)
        if floor:
            text_ms = text_floor_s(num_requests, rate, bucket_ladder) / num_requests * 1e3
            lowest = medians["floor"] + text_ms
            # And each start-up's median process time itself, a few ms apart between trees.
            process_ms = ", ".join(
                f"{label} {statistics.median(r['cpu_s'] for r in runs[label]) * 1e3:.0f}"
                for label, _, _ in start_ups)
            print(f"rate {rate:g}: start-up per request of the trace: floor (python, numpy, "
                  f"absl) {medians['floor']:.4f} ms, a one-request run {medians['one']:.4f} ms"
                  + (f" (the old tree's {medians['oldone']:.4f} ms)" if "oldone" in medians
                     else "") + f" (process ms: {process_ms})"
                  + (f"; old/floor {medians['old'] / medians['floor']:.2f}x: no tree can be "
                     f"more than that faster than the old one here, whatever its loop costs"
                     if "old" in medians else ""), flush=True)
            print(f"rate {rate:g}: the results' text alone (requests.jsonl and steps.jsonl, "
                  f"one %-template a row from values in hand, best of 5) {text_ms:.4f} ms "
                  f"a request; floor and text {lowest:.4f} ms"
                  + (f"; old/(floor and text) {medians['old'] / lowest:.2f}x, leaving "
                     f"{(medians['old'] / 5 - lowest) * 1e3:.1f} us a request for everything "
                     f"else at a fifth of old" if "old" in medians else ""), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--bucket_ladder", default="pow2",
                        help="the run's --bucket_ladder (auto: with the fit's pilot run)")
    parser.add_argument("--old_rev", default=None,
                        help="also run every case at this git revision, interleaved")
    parser.add_argument("--rounds", type=int, default=3,
                        help="with --old_rev: runs of each case at each tree")
    parser.add_argument("--issue_trace", action="store_true",
                        help="leap against noleap on issue 34's trace shape (see above)")
    parser.add_argument("--profile", action="store_true",
                        help="profile one run of issue 34's trace, phase by phase (see above)")
    parser.add_argument("--planner", default=None,
                        help="run every cluster case with this planner (PLANNER_FLAGS); not "
                        "with --old_rev: a revision before planners has no such flags")
    parser.add_argument("--rates", type=float, nargs="+", default=[30.0, 15.0],
                        help="with --issue_trace: the arrival rates, req/s")
    parser.add_argument("--old_noleap", action="store_true",
                        help="with --issue_trace and --old_rev: the old tree's --noleap run "
                        "too (a revision that has the flag): the per-step path in both")
    parser.add_argument("--floor", action="store_true",
                        help="with --issue_trace: time the start-up no tree can go below "
                        "(FLOOR_COMMAND) and this tree's one-request run too (see above)")
    args = parser.parse_args()
    if args.planner and (args.old_rev or args.issue_trace or args.profile):
        parser.error("--planner measures cluster cases at this tree only: drop --old_rev, "
                     "--issue_trace and --profile")
    if args.profile:
        num_requests = args.requests[0] if args.requests != [10_000, 100_000] else 10_000
        print(f"# {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {os.cpu_count()}-core "
              f"machine, load average at start: "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; issue 34's trace: "
              f"{' '.join(ISSUE_TRACE)}, --bucket_ladder={args.bucket_ladder}")
        for rate in args.rates:
            profile_case(num_requests, rate, args.bucket_ladder)
        return
    if args.issue_trace:
        num_requests = args.requests[0] if args.requests != [10_000, 100_000] else 10_000
        print(f"# {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {os.cpu_count()}-core "
              f"machine, load average at start: "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; issue 34's trace: "
              f"{num_requests} requests, {' '.join(ISSUE_TRACE)}, "
              f"--bucket_ladder={args.bucket_ladder}, --rounds={args.rounds}"
              + (f", --old_rev={args.old_rev}" if args.old_rev else "")
              + (", --old_noleap" if args.old_noleap else "")
              + (", --floor" if args.floor else ""))
        if args.old_rev:
            with revision_tree(args.old_rev) as old_tree:
                issue_trace(num_requests, args.rates, args.rounds, args.bucket_ladder, old_tree,
                            args.old_noleap, args.floor)
        else:
            issue_trace(num_requests, args.rates, args.rounds, args.bucket_ladder,
                        floor=args.floor)
        return
    print(f"# {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {os.cpu_count()}-core "
          f"machine, load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}, "
          f"--bucket_ladder={args.bucket_ladder}"
          + (f", --old_rev={args.old_rev} --rounds={args.rounds}" if args.old_rev else "")
          + (f", --planner={args.planner} {' '.join(PLANNER_FLAGS)}" if args.planner else ""))
    print(COLUMNS + ("  tree" if args.old_rev else ""))
    if args.old_rev:
        with revision_tree(args.old_rev) as old_tree:
            trees = {args.old_rev: old_tree, "current": REPO}
            ratios = [compare_case(num_requests, num_replicas, args.bucket_ladder, trees,
                                   args.rounds)
                      for num_requests in args.requests for num_replicas in args.replicas]
        print(f"new/old over all {len(ratios)} cases: geometric mean "
              f"{statistics.geometric_mean(ratios):.3f}")
    else:
        for num_requests in args.requests:
            for num_replicas in args.replicas:
                print(format_row(run_case(num_requests, num_replicas, args.bucket_ladder,
                                          planner=args.planner)), flush=True)
    print(json.dumps({"rate_per_replica": RATE_PER_REPLICA, "policy": "vllm",
                      "bucket_ladder": args.bucket_ladder, "old_rev": args.old_rev,
                      "planner": args.planner}))


if __name__ == "__main__":
    main()
