"""The simulator against public real-GPU runs: `python -m benchmarks.sim_vs_real`.

Replays the development set of real vLLM runs in `../shared/sim2real/` (public
measurements of vLLM 0.15.1 on H100s, published by the team behind the BLIS
simulator; its README says what the client really sent) on `--engine=sim
--policy=vllm` with each run's own limits (max_num_seqs, max_num_batched_tokens,
16-token blocks, the logged KV blocks, prefix caching on) and the engine profile
asked for (`--engine_profile`, default `vllm`), and prints per (run, stage) and per
metric our prediction, the real figure and the error, then the median absolute
error of each metric over every (run, stage) pair, beside the published errors of
BLIS and Vidur on the same pairs where the set has them.

The traces are the set's own (`gen_traces.py`: the runs' real arrivals and prompt
lengths where it has them, the client's pool of 100 prompts), written into a
temporary folder; each run is one `experiments.run` process (`--jobs` at once).

Metrics, per stage (the requests that arrived in it): TTFT mean and p90, E2E mean and
p90, TPOT as the set's README defines it from the client's means, `(E2E mean - TTFT
mean) / (output_len - 1)` (the client's own TPOT re-tokenises the stream), and
throughput in requests/s where the set has it. A held-out set of other runs is scored by this same
command (`--sim2real` naming its folder, `--runs` its ids).

Without the set (`../shared/sim2real/` is not part of the repository) it says where
the data come from and exits with status 2.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_SET = os.path.normpath(os.path.join(HERE, "..", "..", "shared", "sim2real"))
METRICS = ("ttft_mean", "ttft_p90", "e2e_mean", "e2e_p90", "tpot", "throughput")
# The Done-when of the fidelity issue: median absolute errors at most these.
TARGETS = {"e2e_mean": 0.10, "tpot": 0.10, "ttft_mean": 0.20}
PUBLISHED = ("blis-trained-physics", "blis-evolved", "blis-roofline", "vidur")


def load_set(folder: str) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, str]]]:
    """The set's experiments, tier-A truth and s2r records (`SystemExit` 2 if absent)."""
    path = os.path.join(folder, "experiments.json")
    if not os.path.isfile(path):
        print(f"sim_vs_real: no development set at {folder} (experiments.json missing): it "
              "lives in the project's shared/sim2real folder (public vLLM measurements of "
              "inference-sim/training and inference-sim/sim-to-real-accuracy-validation; "
              "see that folder's README); give its path with --sim2real", file=sys.stderr)
        raise SystemExit(2)
    experiments = {k: v for k, v in json.load(open(path)).items() if not k.startswith("_")}
    tier_a_path = os.path.join(folder, "truth", "tierA_training.json")
    tier_a = json.load(open(tier_a_path)) if os.path.isfile(tier_a_path) else {}
    s2r_path = os.path.join(folder, "truth", "s2r_records.csv")
    records = list(csv.DictReader(open(s2r_path))) if os.path.isfile(s2r_path) else []
    return experiments, tier_a, records


def real_stage(exp_id: str, spec: dict[str, Any], stage: int, tier_a: dict[str, Any],
               records: list[dict[str, str]]) -> Optional[dict[str, float]]:
    """The real run's figures for one stage, in seconds and tokens/s (None: no truth)."""
    out_len = spec["sp"]["out"]
    if exp_id in tier_a:
        st = tier_a[exp_id]["stages"][stage]
        real = {"ttft_mean": st["ttft"]["mean"], "ttft_p90": st["ttft"]["p90"],
                "e2e_mean": st["e2e"]["mean"], "e2e_p90": st["e2e"]["p90"],
                "throughput": st["throughput"]["requests_per_sec"]}
    else:
        mine = {r["metric"]: float(r["actual"]) / 1e3 for r in records
                if r["exp"] == exp_id and r["stage"] == str(stage)}
        if "e2e_mean" not in mine or "ttft_mean" not in mine:
            return None
        real = {m: mine[m] for m in ("ttft_mean", "ttft_p90", "e2e_mean", "e2e_p90")
                if m in mine}
    real["tpot"] = (real["e2e_mean"] - real["ttft_mean"]) / (out_len - 1)
    return real


def published_errors(exp_id: str, stage: int, records: list[dict[str, str]]
                     ) -> dict[str, dict[str, float]]:
    """`{simulator: {metric: relative error}}` the set records for one stage."""
    out: dict[str, dict[str, float]] = {}
    for r in records:
        if r["exp"] == exp_id and r["stage"] == str(stage) and r["simulator"] in PUBLISHED:
            actual = float(r["actual"])
            out.setdefault(r["simulator"], {})[r["metric"]] = (
                (float(r["predicted"]) - actual) / actual)
    return out


def run_command(exp_id: str, spec: dict[str, Any], trace: str, out_dir: str,
                profile: str, step_padding: str) -> list[str]:
    """The `experiments.run` command replaying one run."""
    command = [sys.executable, "-m", "experiments.run", "--engine=sim", "--policy=vllm",
               "--workload=trace", f"--trace={trace}", f"--model={spec['model']}",
               f"--hardware={spec['hardware']}", f"--tp={spec['tp']}",
               f"--max_num_seqs={spec['max_num_seqs']}",
               f"--max_num_tokens={spec['mnbt']}", "--page_size=16", "--max_model_len=4096",
               "--prefix_caching=on", f"--engine_profile={profile}",
               f"--step_padding={step_padding}",
               # The profile pads steps its engine's way (vLLM's graph sizes): the ladder is
               # only what the run compiles, so the cheapest one, with no pilot run.
               "--bucket_ladder=pow2", f"--out_dir={out_dir}"]
    if spec.get("kv_blocks"):
        command.append(f"--num_kv_pages={spec['kv_blocks']}")
    return command


def simulated_stages(out_dir: str, spec: dict[str, Any]) -> list[dict[str, float]]:
    """Our figures per stage from a run's requests.jsonl (stages by arrival time)."""
    arrival, first, finish = [], [], []
    with open(os.path.join(out_dir, "requests.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if r["status"] != "finished":
                continue
            arrival.append(r["arrival_s"])
            first.append(r["first_token_s"])
            finish.append(r["finish_s"])
    a, ft, fin = (np.array(x, np.float64) for x in (arrival, first, finish))
    stages, start = [], 0.0
    for rate, duration in spec["stages"]:
        mine = (a >= start) & (a < start + duration)
        start += duration
        ttft, e2e = ft[mine] - a[mine], fin[mine] - a[mine]
        stages.append({
            "ttft_mean": float(ttft.mean()), "ttft_p90": float(np.percentile(ttft, 90)),
            "e2e_mean": float(e2e.mean()), "e2e_p90": float(np.percentile(e2e, 90)),
            "tpot": float((e2e.mean() - ttft.mean()) / (spec["sp"]["out"] - 1)),
            # Requests of the stage finished, over its length (the client's requests/s; its
            # output tokens/s re-tokenise the stream and undercount).
            "throughput": float(mine.sum() / duration)})
    return stages


def replay(exp_id: str, spec: dict[str, Any], folder: str, work: str, profile: str,
           step_padding: str) -> tuple[str, list[dict[str, float]], float]:
    """Writes the run's trace, replays it, and returns its stages and wall seconds."""
    start = time.perf_counter()
    made = subprocess.run([sys.executable, os.path.join(folder, "gen_traces.py"), "--outdir",
                           work, exp_id], capture_output=True, text=True)
    if made.returncode != 0:
        last = made.stderr.strip().splitlines()[-1:] or ["no message"]
        raise RuntimeError(f"{exp_id}: its trace could not be made: {last[0]}")
    out_dir = os.path.join(work, f"{exp_id}_out")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(run_command(exp_id, spec, os.path.join(work, f"{exp_id}.jsonl"),
                                      out_dir, profile, step_padding),
                          capture_output=True, text=True, env=env,
                          cwd=os.path.dirname(HERE))
    if done.returncode != 0:
        last = done.stderr.strip().splitlines()[-1:] or ["no message"]
        raise RuntimeError(f"{exp_id}: the run failed ({done.returncode}): {last[0]}")
    return exp_id, simulated_stages(out_dir, spec), time.perf_counter() - start


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sim2real", default=DEFAULT_SET, help="the set's folder")
    parser.add_argument("--engine_profile", default="vllm")
    parser.add_argument("--step_padding", default="bucket", choices=("bucket", "ragged"),
                        help="bucket: as the profile's engine pads (vllm: its graph sizes)")
    parser.add_argument("--runs", default="", help="comma-separated run ids (all: empty)")
    parser.add_argument("--jobs", type=int, default=2, help="runs replayed at once")
    args = parser.parse_args(argv)
    experiments, tier_a, records = load_set(args.sim2real)
    ids = [i for i in (args.runs.split(",") if args.runs else experiments) if i]
    unknown = [i for i in ids if i not in experiments]
    if unknown:
        print(f"sim_vs_real: unknown runs {unknown}; the set has {sorted(experiments)}",
              file=sys.stderr)
        return 2
    print(f"engine profile {args.engine_profile}, step padding {args.step_padding}; "
          f"set {args.sim2real}; runs {','.join(ids)}")
    results: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as work, \
            concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(replay, i, experiments[i], args.sim2real, work,
                               args.engine_profile, args.step_padding) for i in ids]
        for future in concurrent.futures.as_completed(futures):
            try:
                exp_id, stages, seconds = future.result()
            except RuntimeError as e:  # one run the simulator cannot replay: said, not fatal
                print(f"  not scored: {e}", flush=True)
                continue
            results[exp_id] = stages
            print(f"  replayed {exp_id} in {seconds:.0f} s", flush=True)
    errors: dict[str, list[float]] = {m: [] for m in METRICS}
    theirs: dict[str, dict[str, list[float]]] = {s: {} for s in PUBLISHED}
    print(f"\n{'run':4} {'st':>2} {'rate':>5}  " + "  ".join(
        f"{m:>22}" for m in METRICS) + "   (ours / real / error; seconds, requests/s)")
    worst: list[tuple[float, str]] = []
    for exp_id in (i for i in ids if i in results):
        spec = experiments[exp_id]
        for stage, ours in enumerate(results[exp_id]):
            real = real_stage(exp_id, spec, stage, tier_a, records)
            if real is None:
                continue
            cells = []
            for m in METRICS:
                if m not in real:
                    cells.append(f"{'-':>22}")
                    continue
                error = (ours[m] - real[m]) / real[m]
                errors[m].append(abs(error))
                cells.append(f"{ours[m]:7.3f} {real[m]:7.3f} {error:+6.1%}")
            worst.append((abs((ours["e2e_mean"] - real["e2e_mean"]) / real["e2e_mean"]),
                          f"{exp_id} stage {stage}"))
            print(f"{exp_id:4} {stage:>2} {spec['stages'][stage][0]:>5}  " + "  ".join(cells))
            for sim, errs in published_errors(exp_id, stage, records).items():
                for metric, value in errs.items():
                    theirs[sim].setdefault(metric, []).append(abs(value))
    print("\nmedian absolute error over the (run, stage) pairs:")
    for m in METRICS:
        if errors[m]:
            median, target = statistics.median(errors[m]), TARGETS.get(m)
            verdict = "" if target is None else (
                f"  (target <= {target:.0%}: {'met' if median <= target else 'NOT met'})")
            print(f"  {m:11} {median:6.1%} over {len(errors[m])} pairs, "
                  f"max {max(errors[m]):6.1%}{verdict}")
    if not worst:
        print("  no (run, stage) pair was scored")
        return 1
    e2e_worst = max(worst)
    print(f"  worst E2E mean: {e2e_worst[1]} at {e2e_worst[0]:.1%} (target <= 30%: "
          f"{'met' if e2e_worst[0] <= 0.30 else 'NOT met'})")
    print("\npublished simulators on the pairs the set records for them (median absolute, "
          "their own subsets; itl_mean is their TPOT):")
    for sim in PUBLISHED:
        parts = [f"{metric} {statistics.median(values):.1%} ({len(values)})"
                 for metric, values in sorted(theirs[sim].items())
                 if metric in ("e2e_mean", "ttft_mean", "itl_mean")]
        if parts:
            print(f"  {sim:21} " + ", ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
