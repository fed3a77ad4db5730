"""Our simulator beside Vidur on issue 34's trace: process time, wall time, peak memory.

Vidur lives outside the repository, in an environment of its own (CI has none):

    python -m venv /work/vidur-venv && /work/vidur-venv/bin/pip install vidur==0.0.26
    python -m benchmarks.vs_vidur --vidur_python /work/vidur-venv/bin/python --rounds 3 \
        > benchmarks/results/vs_vidur_<yyyymmdd>.txt

The trace (issue 34): 10,000 Poisson requests at each of `--rates` (30 and 15 req/s),
prompts of 300 tokens, outputs of 100, one Llama-3-8B replica on one A100, a
vLLM-style scheduler with a batch cap of 256 and a 4,096-token batch. Ours is
`benchmarks/sim_speed.py`'s command (`trace_command`: `ISSUE_TRACE`, the default
leaping mode, `--bucket_ladder=pow2` so that a run is one simulation); Vidur's is
`vidur_command`: its `vllm` replica scheduler, its synthetic request generator with the
fixed length generator and Poisson intervals, seed 42, its metrics in a temporary
folder, plots and the Chrome trace off (`--no-metrics_config_store_plots` still writes
the plots' CSV data; the request metrics stay on, they are what the run is checked by;
wandb is off while no project is named). Each round runs both at each rate, the order
turning from rate to rate and round to round, and each tool's run of one request (its
start-up: imports, its predictor tables or our workload, the results files), every one
a child process measured by `sim_speed.run_child`: process time (user + system),
wall time and peak resident set. Per rate: the medians, vidur/ours, and the process
time per request net of the median one-request run, and per step: ours counts its
steps.jsonl, and Vidur runs once more, untimed, keeping each batch's metrics
(`--metrics_config_keep_individual_batch_metrics`, whose bookkeeping would tax a timed
run) to count its batches.

Vidur 0.0.26 ships no profiling data: its execution-time predictor downloads it from
Hugging Face datasets (the defaults name an H100), which this machine cannot reach.
`write_vidur_inputs` lays the data out as a local snapshot of such datasets
(Hugging Face's cache layout under `--vidur_cache`; Vidur runs with
`HF_HUB_OFFLINE=1`): its own A100 Llama-3-8B per-layer kernel times and A100 DGX
network times (`--profiles`, the files `docs/calibration.md` describes), and, since
its attention tables are shipped nowhere here, attention kernels priced by our
per-operation roofline (`attention_table`), per layer, on a grid of decode batches and
prefill chunks. Vidur's attention is then ours, its linear layers its measurements.
Its first run trains its random forests and caches them and their predictions in
`--vidur_cache` (a warm-up, printed, never counted); every timed run loads them. Three
of its flags leave their defaults: `prediction_max_batch_size` 256 (at 128, its default,
the predictor has no entry for the trace's 256-request decode batches),
`prediction_max_tokens_per_request` 4096 (at 2^21, its tables predict every token
count up to two million), and one value each for the forests' grid search (250 trees
of depth 32: the forests every run unpickles, 190 MB of files here). Each run's
simulated latencies are printed, Vidur's beside ours, as a check that both simulate the
same trace: they need not match (different cost models), and where arrivals outrun a
replica (30 req/s) its queue grows through the run, so a small gap in service rate is a
large gap in latency. Every run must finish all its requests.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import lzma
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from benchmarks.old_revision import REPO, tree_env
from benchmarks.sim_speed import ISSUE_TRACE, run_child, trace_command

PROFILES = REPO.parent / "shared" / "profiles" / "vidur_a100_h100"
VIDUR_MODEL = "meta-llama/Llama-3-8B"  # Vidur's name for the shapes of our llama3-8b
# Vidur's input files, from `--profiles`: its dataset file name -> ours.
COMPUTE_FILES = {"mlp.csv.xz": "a100_meta-llama-3-8b_mlp.csv"}
NETWORK_FILES = {"all_reduce.csv.xz": "a100_dgx_all_reduce.csv",
                 "send_recv.csv.xz": "a100_dgx_send_recv.csv"}
SNAPSHOT = "0" * 40  # the one revision of each local dataset
# The attention grid (`attention_table`): decode batches by KV tokens a sequence,
# prefill chunks by tokens cached before them, up to the 4,096 tokens of a batch.
DECODE_BATCHES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256)
DECODE_KV = range(0, 4097, 64)
PREFILL_CHUNKS = range(32, 4097, 32)
PREFILL_KV = range(0, 4097, 128)
BLOCK_SIZE = 16  # Vidur's default KV block; its attention rows are filtered by it
PREDICTOR = "--random_forrest_execution_time_predictor_config_"  # (sic) its flags' prefix
TOOLS = ("ours", "vidur")


def attention_table() -> str:
    """Vidur's attention profile (its columns, milliseconds per layer) priced by our
    per-operation roofline for llama3-8b on an A100: decode rows (`prefill_chunk_size`
    0) of `batch_size` sequences of `kv_cache_size` tokens each, and prefill rows of one
    chunk of `prefill_chunk_size` tokens after `kv_cache_size` cached ones."""
    # Imported here, and run in a child (`write_vidur_inputs`): this process stays small,
    # since a child's peak resident set, as `os.wait4` gives it, is at least its parent's.
    import numpy as np

    from orca_jax.sim.cost_model import CostModelConfig

    config = CostModelConfig(model="llama3-8b", hardware="a100")
    model, roofline = config.model_config, config.per_op_roofline
    ms_per_layer = 1e3 / model.num_layers
    shape = (f"{model.d_model},{model.num_q_heads},{model.num_kv_heads},{BLOCK_SIZE},1")
    rows = ["n_embd,n_q_head,n_kv_head,block_size,num_tensor_parallel_workers,batch_size,"
            "prefill_chunk_size,kv_cache_size,time_stats.attn_prefill.median,"
            "time_stats.attn_decode.median"]
    for batch in DECODE_BATCHES:
        for kv in DECODE_KV:
            seconds = roofline.breakdown(np.ones(batch, np.int64),  # [batch]
                                         np.full(batch, max(kv, 1)))["attention_decode"]
            rows.append(f"{shape},{batch},0,{kv},0.0,{seconds * ms_per_layer!r}")
    for chunk in PREFILL_CHUNKS:
        for kv in PREFILL_KV:
            seconds = roofline.breakdown(np.array([chunk]),  # [1]
                                         np.array([kv + chunk]))["attention_prefill"]
            rows.append(f"{shape},1,{chunk},{kv},{seconds * ms_per_layer!r},0.0")
    return "\n".join(rows) + "\n"


def write_vidur_inputs(cache_dir: Path, profiles: Path) -> tuple[str, str]:
    """Writes Vidur's compute and network profiling datasets as local snapshots under
    `cache_dir` (where `huggingface_hub.snapshot_download` looks offline) and returns
    their names. A name ends with a digest of its files, so Vidur's predictions, cached
    under a hash of the dataset's name, are never those of other inputs."""
    compute = {name: (profiles / ours).read_text() for name, ours in COMPUTE_FILES.items()}
    compute["attention.csv.xz"] = subprocess.run(  # in a child: see `attention_table`
        [sys.executable, "-c", "import sys; from benchmarks.vs_vidur import attention_table; "
         "sys.stdout.write(attention_table())"],
        cwd=REPO, env=tree_env(REPO), capture_output=True, text=True, check=True).stdout
    network = {name: (profiles / ours).read_text() for name, ours in NETWORK_FILES.items()}
    names = []
    for kind, files, config in (("compute", compute, {"model": VIDUR_MODEL,
                                                      "device_sku": "a100"}),
                                ("network", network, {"sku": "a100_dgx"})):
        digest = hashlib.sha256(json.dumps([config, files], sort_keys=True).encode())
        name = f"orca-jax/vidur-{kind}-a100-{digest.hexdigest()[:10]}"
        root = cache_dir / "profiling_data" / kind / f"datasets--{name.replace('/', '--')}"
        snapshot = root / "snapshots" / SNAPSHOT
        if not (snapshot / "config.json").exists():
            snapshot.mkdir(parents=True, exist_ok=True)
            for file_name, text in files.items():
                with lzma.open(snapshot / file_name, "wt") as out:  # Vidur reads .csv.xz
                    out.write(text)
            (root / "refs").mkdir(exist_ok=True)
            (root / "refs" / "main").write_text(SNAPSHOT)
            (snapshot / "config.json").write_text(json.dumps(config))  # last: complete
        names.append(name)
    return names[0], names[1]


def vidur_command(vidur_python: str, num_requests: int, rate: float, cache_dir: Path,
                  datasets: tuple[str, str], out_dir: str) -> list[str]:
    """Vidur's command line for the issue's trace at `rate` req/s (see the module doc)."""
    compute, network = datasets
    return [vidur_python, "-m", "vidur.main", "--seed", "42",
            "--cluster_config_num_replicas", "1",
            "--replica_config_model_name", VIDUR_MODEL,
            "--replica_config_device", "a100", "--replica_config_network_device", "a100_dgx",
            "--replica_config_tensor_parallel_size", "1",
            "--replica_config_num_pipeline_stages", "1",
            "--replica_scheduler_config_type", "vllm",
            "--vllm_scheduler_config_batch_size_cap", "256",
            "--vllm_scheduler_config_max_tokens_in_batch", "4096",
            "--request_generator_config_type", "synthetic",
            "--synthetic_request_generator_config_num_requests", str(num_requests),
            "--length_generator_config_type", "fixed",
            "--fixed_request_length_generator_config_prefill_tokens", "300",
            "--fixed_request_length_generator_config_decode_tokens", "100",
            "--interval_generator_config_type", "poisson",
            "--poisson_request_interval_generator_config_qps", f"{rate:g}",
            "--poisson_request_interval_generator_config_seed", "42",
            "--execution_time_predictor_config_type", "random_forrest",
            f"{PREDICTOR}model_profiling_dataset", compute,
            f"{PREDICTOR}network_profiling_dataset", network,
            f"{PREDICTOR}cache_dir", str(cache_dir),
            f"{PREDICTOR}prediction_max_batch_size", "256",
            f"{PREDICTOR}prediction_max_tokens_per_request", "4096",
            f"{PREDICTOR}num_estimators", "250", f"{PREDICTOR}max_depth", "32",
            f"{PREDICTOR}min_samples_split", "2",
            "--no-metrics_config_store_plots", "--no-metrics_config_enable_chrome_trace",
            "--no-metrics_config_write_json_trace", "--metrics_config_output_dir", out_dir]


def vidur_env() -> dict[str, str]:
    """Vidur's environment: offline (its datasets are local), none of our PYTHONPATH,
    and bytecode written as an installed package has it (this workplace turns it off)."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}
    env["HF_HUB_OFFLINE"] = "1"
    return env


def check_vidur(vidur_python: str) -> str:
    """Vidur's version; exits with one line where the interpreter is missing or Vidur
    does not import in it."""
    if not Path(vidur_python).is_file():
        sys.exit(f"--vidur_python {vidur_python}: no such file (install Vidur: see "
                 "benchmarks/vs_vidur.py)")
    result = subprocess.run([vidur_python, "-c", "import importlib.metadata, vidur.main; "
                             "print(importlib.metadata.version('vidur'))"],
                            env=vidur_env(), capture_output=True, text=True)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no error printed"])[-1]
        sys.exit(f"--vidur_python {vidur_python}: vidur does not import ({last})")
    return result.stdout.strip()


def latencies(e2e_s: list[float], ttft_s: list[float]) -> dict[str, float]:
    """Mean and median end-to-end latency and time to first token, seconds."""
    return {"e2e_mean": statistics.fmean(e2e_s), "e2e_p50": statistics.median(e2e_s),
            "ttft_mean": statistics.fmean(ttft_s), "ttft_p50": statistics.median(ttft_s)}


def our_results(run_dir: Path) -> tuple[int, dict[str, float]]:
    """Finished requests and simulated latencies of one of our runs (requests.jsonl)."""
    rows = [json.loads(line) for line in open(run_dir / "requests.jsonl")]
    done = [r for r in rows if r["finish_s"] is not None]
    return len(done), latencies([r["finish_s"] - r["arrival_s"] for r in done],
                                [r["first_token_s"] - r["arrival_s"] for r in done])


def vidur_results(out_dir: Path) -> tuple[int, dict[str, float]]:
    """Finished requests and simulated latencies of one Vidur run (the request metrics
    it writes into a dated folder under its output folder, a row per finished request)."""
    (metrics,) = out_dir.glob("*/request_metrics.csv")
    with open(metrics, newline="") as file:
        rows = list(csv.DictReader(file))
    return len(rows), latencies([float(r["request_e2e_time"]) for r in rows],
                                [float(r["prefill_e2e_time"]) for r in rows])


def vidur_batches(out_dir: Path) -> int:
    """The batches one Vidur run kept, a row each (`batch_metrics.csv`, written only with
    `--metrics_config_keep_individual_batch_metrics`)."""
    (metrics,) = out_dir.glob("*/batch_metrics.csv")
    with open(metrics, newline="") as file:
        return sum(1 for _ in csv.DictReader(file))


def count_vidur_batches(num_requests: int, rate: float,
                        vidur: tuple[str, Path, tuple[str, str]]) -> int:
    """The batches Vidur simulates for the trace at `rate`, counted in a run of its own
    that keeps each batch's metrics (their bookkeeping would tax a timed run)."""
    python, cache_dir, datasets = vidur
    with tempfile.TemporaryDirectory() as out:
        run_child(vidur_command(python, num_requests, rate, cache_dir, datasets, f"{out}/run")
                  + ["--metrics_config_keep_individual_batch_metrics"], Path(out), vidur_env(),
                  "vidur.main")
        return vidur_batches(Path(out, "run"))


def measure(tool: str, num_requests: int, rate: float, bucket_ladder: str,
            vidur: Optional[tuple[str, Path, tuple[str, str]]] = None) -> dict:
    """One run of `tool` (`ours`, or `vidur` with `(python, cache, datasets)`) in a
    child process: its process, wall and peak figures and its simulated latencies.
    Exits if it finished fewer than `num_requests` requests."""
    with tempfile.TemporaryDirectory() as out:
        if tool == "ours":
            run = run_child(trace_command(num_requests, rate, None, bucket_ladder,
                                          f"{out}/run"),
                            REPO, tree_env(REPO, JAX_PLATFORMS="cpu"), "experiments.run")
            finished, simulated = our_results(Path(out, "run"))
            simulated["steps"] = sum(1 for _ in open(Path(out, "run", "steps.jsonl")))
        else:
            assert vidur is not None
            python, cache_dir, datasets = vidur
            run = run_child(vidur_command(python, num_requests, rate, cache_dir, datasets,
                                          f"{out}/run"), Path(out), vidur_env(), "vidur.main")
            finished, simulated = vidur_results(Path(out, "run"))
    if finished != num_requests:
        sys.exit(f"{tool} at {rate:g} req/s finished {finished} of {num_requests} requests")
    return {"cpu_s": run.cpu_s, "wall_s": run.wall_s, "peak_mib": run.peak_mib,
            "ms_per_request": run.cpu_s / num_requests * 1e3, **simulated}


def summarize(runs: dict[str, list[dict]], start_ups: dict[str, list[dict]],
              num_requests: int, steps: dict[str, int]) -> dict[str, dict[str, float]]:
    """Per tool the medians of its runs (`cpu_s`, `wall_s`, `peak_mib`, `ms_per_request`)
    and of its one-request runs (`start_cpu_s`, `start_peak_mib`), and the process time
    per request net of that start-up (`net_ms_per_request`), its `steps` (ours: steps,
    Vidur's: batches) and the net process time per step (`net_us_per_step`); under
    `vidur/ours` the ratio of each."""
    table: dict[str, dict[str, float]] = {}
    for tool in TOOLS:
        row = {key: statistics.median(r[key] for r in runs[tool])
               for key in ("cpu_s", "wall_s", "peak_mib", "ms_per_request")}
        row["start_cpu_s"] = statistics.median(r["cpu_s"] for r in start_ups[tool])
        row["start_peak_mib"] = statistics.median(r["peak_mib"] for r in start_ups[tool])
        row["net_ms_per_request"] = (row["cpu_s"] - row["start_cpu_s"]) / num_requests * 1e3
        row["steps"] = steps[tool]
        row["net_us_per_step"] = (row["cpu_s"] - row["start_cpu_s"]) / steps[tool] * 1e6
        table[tool] = row
    table["vidur/ours"] = {key: table["vidur"][key] / table["ours"][key]
                           for key in table["ours"]}
    return table


def format_summary(rate: float, table: dict[str, dict[str, float]]) -> str:
    """The medians of one rate as the lines the output ends with."""
    lines = [f"rate {rate:g}: medians   {'process s':>9} {'ms/request':>10} "
             f"{'net ms/req':>10} {'wall s':>7} {'peak MiB':>8} {'start s':>7} "
             f"{'start MiB':>9} {'steps':>8} {'net us/step':>11}"]
    for label, row in table.items():
        cells = []
        for key, width in (("cpu_s", 9), ("ms_per_request", 10), ("net_ms_per_request", 10),
                           ("wall_s", 7), ("peak_mib", 8), ("start_cpu_s", 7),
                           ("start_peak_mib", 9), ("steps", 8), ("net_us_per_step", 11)):
            cells.append(f"{row[key]:>{width - 1}.2f}x" if label == "vidur/ours"
                         else f"{row[key]:>{width}.0f}" if key == "steps"
                         else f"{row[key]:>{width}.3f}")
        lines.append(f"rate {rate:g}: {label:<10} " + " ".join(cells))
    return "\n".join(lines)


def format_run(rate: float, round_index: int, tool: str, row: dict) -> str:
    """One run's line (a one-request run has no latencies worth printing)."""
    line = (f"{rate:>5g} {round_index:>5} {tool:<8} {row['cpu_s']:>9.2f} "
            f"{row['ms_per_request']:>10.3f} {row['wall_s']:>7.2f} {row['peak_mib']:>8.1f}")
    if "e2e_mean" in row and not tool.endswith(" 1"):
        line += "".join(f" {row[key]:>9.2f}" for key in ("e2e_mean", "e2e_p50", "ttft_mean",
                                                           "ttft_p50"))
    return line


def header(vidur_version: str, args: argparse.Namespace) -> str:
    """The first line: date, load, this tree's revision, what is compared."""
    rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain",
                            "--untracked-files=no"], capture_output=True, text=True).stdout
    return (f"# {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} load "
            f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} tree {rev}"
            f"{'+changes' if dirty.strip() else ''} vs Vidur {vidur_version}: issue 34's "
            f"trace, {args.requests} requests at {' and '.join(f'{r:g}' for r in args.rates)}"
            f" req/s, --rounds={args.rounds}, {os.cpu_count()}-core machine")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vidur_python", required=True,
                        help="the interpreter of an environment with vidur==0.0.26")
    parser.add_argument("--rates", type=float, nargs="+", default=[30.0, 15.0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--bucket_ladder", default="pow2", help="our run's --bucket_ladder")
    parser.add_argument("--profiles", type=Path, default=PROFILES,
                        help="Vidur's profiling files (default: ../shared/profiles/"
                        "vidur_a100_h100 from the repository root)")
    parser.add_argument("--vidur_cache", type=Path,
                        default=Path(tempfile.gettempdir()) / "vs_vidur_cache",
                        help="Vidur's datasets, trained predictors and predictions")
    args = parser.parse_args()
    version = check_vidur(args.vidur_python)
    if not args.profiles.is_dir():
        sys.exit(f"--profiles={args.profiles}: no such folder (Vidur's files: see "
                 "docs/calibration.md)")
    datasets = write_vidur_inputs(args.vidur_cache, args.profiles)
    vidur = (args.vidur_python, args.vidur_cache, datasets)
    first = args.rates[0]
    ours = trace_command(args.requests, first, None, args.bucket_ladder, "OUT")
    theirs = vidur_command(args.vidur_python, args.requests, first, args.vidur_cache,
                           datasets, "OUT")
    print(header(version, args))
    print(f"# ours at {first:g} req/s (ISSUE_TRACE: {' '.join(ISSUE_TRACE)}), in {REPO}:\n"
          f"#   {shlex.join(ours)}")
    print(f"# vidur at {first:g} req/s, in a temporary folder:\n"
          f"#   HF_HUB_OFFLINE=1 {shlex.join(theirs)}")
    warm_up = measure("vidur", 1, first, args.bucket_ladder, vidur)
    print("# vidur's warm-up run (trains its predictors where --vidur_cache has none; not "
          f"counted): {warm_up['cpu_s']:.2f} process s, peak {warm_up['peak_mib']:.1f} MiB")
    warm_up = measure("ours", 1, first, args.bucket_ladder)
    print(f"# ours' warm-up run (not counted): {warm_up['cpu_s']:.2f} process s, peak "
          f"{warm_up['peak_mib']:.1f} MiB")
    print(f"# this process's peak: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.1f}"
          " MiB, a floor under every peak below (Linux counts a parent's peak in its child's)")
    print(f"{'rate':>5} {'round':>5} {'tool':<8} {'process s':>9} {'ms/request':>10} "
          f"{'wall s':>7} {'peak MiB':>8} {'e2e mean':>9} {'e2e p50':>9} {'ttft mean':>9} "
          f"{'ttft p50':>9}   (latencies: simulated seconds)", flush=True)
    runs = {rate: {tool: [] for tool in TOOLS} for rate in args.rates}
    start_ups: dict[str, list[dict]] = {tool: [] for tool in TOOLS}
    for round_index in range(args.rounds):
        for rate_index, rate in enumerate(args.rates):
            turn = (round_index + rate_index) % 2
            for tool in TOOLS[::-1] if turn else TOOLS:
                row = measure(tool, args.requests, rate, args.bucket_ladder, vidur)
                runs[rate][tool].append(row)
                print(format_run(rate, round_index, tool, row), flush=True)
        for tool in TOOLS[::-1] if round_index % 2 else TOOLS:  # start-ups: one request
            row = measure(tool, 1, args.rates[0], args.bucket_ladder, vidur)
            row["ms_per_request"] = row["cpu_s"] / args.requests * 1e3  # per trace request
            start_ups[tool].append(row)
            print(format_run(args.rates[0], round_index, f"{tool} 1", row), flush=True)
    steps = {}
    for rate in args.rates:  # ours: every run's steps.jsonl; Vidur's: a run that keeps them
        ours_steps = {r["steps"] for r in runs[rate]["ours"]}
        if len(ours_steps) != 1:
            sys.exit(f"ours at {rate:g} req/s simulated {sorted(ours_steps)} steps in its runs")
        steps[rate] = {"ours": ours_steps.pop(),
                       "vidur": count_vidur_batches(args.requests, rate, vidur)}
    print("# net ms/req: (median process s - median one-request run's) / requests; "
          "start: the one-request runs; steps: ours' steps, Vidur's batches (counted in one "
          "more run that keeps each batch's metrics, not timed); net us/step: the net "
          "process time over them")
    for rate in args.rates:
        print(format_summary(rate, summarize(runs[rate], start_ups, args.requests,
                                             steps[rate])))
    print(f"# load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
