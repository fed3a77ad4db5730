"""CachedAttention (ATC'24): multi-turn conversations with their KV history in host memory, on disk.

    python -m experiments.reproduce.cached_attention

CachedAttention (Gao et al., "Cost-Efficient Large Language Model Serving for
Multi-turn Conversations with CachedAttention", USENIX ATC'24) keeps each
conversation's KV after its turn in a hierarchy below the GPU (host DRAM, then
SSD; its AttentionStore) and loads it back at the next turn instead of computing
the history again. On ShareGPT conversations with LLaMA-1 13B/65B, LLaMA-2 70B and
Falcon-40B on A100s it reports TTFT down by up to 87% and prompt prefill throughput
up by up to 7.8x against recomputing the history.

Here, on the simulator: LLaMA-2 70B (the paper's, GQA) on four A100-80GB (tp 4,
each GPU holds and moves its own share of the KV heads), `vllm` (chunked prefill),
the project's conversation workload (`--workload=conversation`: each turn's prompt
is the whole conversation so far and a new message; conversations arrive as a
Poisson process at the swept rate, turns a think time apart). The conversation
workload rather than turns rebuilt from the Mooncake trace's block hashes: its
turns are the paper's shape (history, then a message) with known conversations,
its rate is a knob (the two rates are real loads, not one trace's time scale), it
runs in seconds, and the Mooncake trace's tiers are measured already
(`experiments.reproduce.kv_tiers_mooncake`).

The device pool is `device_pages`, far less than the histories of the
conversations between turns (the `unbounded device` row's peak says how much
they take), as HBM is against the thousands of sessions the paper serves. The
setups, every one on that pool and the same requests:

  * `recompute`: no prefix cache: every turn computes its history again (the
    paper's baseline);
  * `device cache`: the device's prefix cache alone (LRU; what the pool keeps);
  * `host`: a host tier (PCIe 4, as A100 hosts have) that holds every history;
  * `small host`: a host tier of `small_host_share` of that, alone;
  * `small host + disk`: the same, over a disk tier (NVMe) that holds every history;
  * `+ prefetch`: the same with the `prefetch-on-queue` cache policy (disk pages
    of the waiting queue's head start towards the host: the paper's
    scheduler-aware fetching);
  * `unbounded device`: no tier, a pool that never evicts (the upper bound; its
    peak of held pages is printed).

TTFT (mean, p50, p99 over the finished turns) and prefill throughput: the prompt
tokens (history and message) of the turns that got their first token, over the
seconds of the steps that carried prefill work (their KV stalls included; a step
that also decodes counts whole, in every setup alike).

Raw output: `benchmarks/results/cached_attention.txt`.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Optional, Sequence

import numpy as np
from absl import flags

from experiments.executor_flags import executor_from_flags
from experiments.reproduce.common import (
    PAPER_STEP_PADDING,
    PolicyRun,
    parse_flags,
    reproduction_flags,
    run_app,
    run_grid,
    write_figure_and_report,
    write_table,
)
from orca_jax.core.requests.run_result import RunResult
from orca_jax.results import metrics
from orca_jax.results.sweep_store import aggregate
from orca_jax.runner.build import build_workload
from orca_jax.runner.spec import LimitsSpec, RunSpec, SimEngineSpec, WorkloadSpec
from orca_jax.runner.sweep import SweepExecutor

FIGURE = "cached_attention_ttft.png"  # under --out_dir (docs/figures/ has the documented one)
RATE = "offered_rate_req_s"  # the sweep's rate: conversations per second
TTFT_MEAN = "ttft_mean_s"
PREFILL = "prefill_tok_s"
PAPER_TTFT_REDUCTION = 0.87  # CachedAttention: TTFT down by up to 87%
PAPER_PREFILL_SPEEDUP = 7.8  # and prompt prefill throughput up to 7.8x
BASELINE = "recompute"
SETUPS = (BASELINE, "device cache", "host", "small host", "small host + disk",
          "small host + disk + prefetch", "unbounded device")  # the tables' order
COLUMNS = ["setup", "rate", TTFT_MEAN, "ttft_p50_s", "ttft_p99_s", PREFILL, "prefix_hit_rate",
           "host_hit_tokens", "disk_hit_tokens", "stall_s", "num_finished", "peak_held_pages"]
DIFFERS = ("What differs: one of their models (LLaMA-2 70B, not LLaMA-13B/65B or Falcon-40B) "
           "on a simulated A100 roofline, not their testbed; a synthetic "
           "conversation workload (ShareGPT-like lengths, our think times), not ShareGPT "
           "itself; a load from host or disk here stalls its whole step, where "
           "CachedAttention pre-loads layer by layer behind the compute and saves "
           "asynchronously; turns past the 4,096-token context are rejected, where "
           "CachedAttention truncates them and keeps their KV valid (decoupled positional "
           "encoding); and vllm's chunked prefill batches prefills with decodes.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CachedAttentionSetup:
    """The experiment (defaults: the documented tables; about two minutes on 2 cores)."""

    num_requests: int = 300  # turns per point
    rates: tuple[float, ...] = (0.25, 0.5)  # conversations per second
    seeds: tuple[int, ...] = (0,)
    model: str = "llama2-70b"
    hardware: str = "a100"
    tp: int = 4
    max_num_seqs: int = 64
    # ShareGPT-like: a few turns, messages of tens to hundreds of tokens, longer answers.
    num_turns: str = "uniform:2:10"
    message_len: str = "uniform:16:256"
    output_len: str = "uniform:32:512"
    think_time_ms: str = "lognormal:30000:0.5"
    # 48k tokens: the running turns' prompts and answers (about 2,100 - 2,400 pages at the
    # unbounded pool's peak), and a part of the histories between turns.
    device_pages: int = 3072
    small_host_share: float = 0.125  # the small host tier: this share of every history
    host_link: str = "pcie4"
    disk_link: str = "nvme"
    unbounded_pages: int = 1_000_000

    def spec(self, **limits: Any) -> RunSpec:
        """The workload and engine (rate and seed are set per point), on `limits`."""
        return RunSpec(
            workload=WorkloadSpec(arrival="conversation", num_requests=self.num_requests,
                                  rate=self.rates[0], num_turns=self.num_turns,
                                  suffix_len=self.message_len, output_len=self.output_len,
                                  think_time_ms=self.think_time_ms),
            engine=SimEngineSpec(model=self.model, hardware=self.hardware, tp=self.tp,
                                 step_padding=PAPER_STEP_PADDING),
            limits=LimitsSpec(max_num_seqs=self.max_num_seqs, **limits))

    def history_pages(self) -> int:
        """Pages that hold every turn's KV at its end (prompt and answer), summed over the
        turns at every swept rate and seed, the most of them: at least the working set
        (turns share their history's pages), so a tier of this many never evicts."""
        page = LimitsSpec().page_size
        most = 0
        for rate in self.rates:
            for seed in self.seeds:
                spec = self.spec()
                spec = dataclasses.replace(spec, seed=seed, workload=dataclasses.replace(
                    spec.workload, rate=rate))
                most = max(most, sum((r.prompt_len + r.output_len) // page
                                     for r in build_workload(spec)))
        return max(most, 1)

    def variants(self) -> dict[str, RunSpec]:
        """The setups, label -> spec, in `SETUPS`' order."""
        history = self.history_pages()
        small = max(int(history * self.small_host_share), 1)
        pool = {"num_kv_pages": self.device_pages, "prefix_caching": "on"}
        host = {**pool, "kv_host_link": self.host_link}
        disk = {**host, "kv_host_pages": small, "kv_disk_pages": history,
                "kv_disk_link": self.disk_link}
        specs = (self.spec(num_kv_pages=self.device_pages, prefix_caching="off"),
                 self.spec(**pool),
                 self.spec(**host, kv_host_pages=history),
                 self.spec(**host, kv_host_pages=small),
                 self.spec(**disk),
                 self.spec(**disk, kv_cache_policy="prefetch-on-queue"),
                 self.spec(num_kv_pages=self.unbounded_pages, prefix_caching="on"))
        return dict(zip(SETUPS, specs, strict=True))


def conversation_metrics(result: RunResult) -> dict[str, Any]:
    """The fields the tables add to a run's summary: mean TTFT, prefill throughput, the
    disk tier's hits and the peak of device pages held."""
    per_request = metrics.request_metrics(result.arrival_s, result.first_scheduled_s,
                                          result.first_token_s, result.finish_s,
                                          result.output_len, result.token_req,
                                          result.token_time_s, token_stats=result.token_stats)
    finished = np.isfinite(result.finish_s)  # [N] (the summary's TTFTs are of these)
    ttft = per_request["ttft_s"][finished]
    started = np.isfinite(result.first_token_s)  # [N] turns whose prefill completed
    steps = result.steps
    step = steps.column("step")  # [S]
    prefill = steps.column("num_tokens") > steps.column("num_seqs")  # [S] a prompt chunk
    stall = np.array([result.kv_stall_s.get(int(i), 0.0) for i in step[prefill]])
    seconds = float(steps.column("step_s")[prefill].sum() + stall.sum())
    tokens = float(np.asarray(result.prompt_len)[started].sum())
    tiers = result.kv_tiers or {}
    return {TTFT_MEAN: float(ttft.mean()) if ttft.size else None,
            PREFILL: tokens / seconds if seconds > 0 else None,
            "disk_hit_tokens": int(tiers.get("disk", {}).get("hit_tokens", 0)),
            "min_free_pages": int(steps.column("num_free_pages").min()) if len(steps) else 0}


def run(setup: CachedAttentionSetup, out_dir: str,
        executor: Optional[SweepExecutor] = None) -> tuple[list[dict[str, Any]], list]:
    """Every setup at every rate (on `executor`, default here): one row per point, and
    the mean-TTFT curves."""
    variants = setup.variants()
    spec = next(iter(variants.values()))
    points, keys = run_grid(spec, [PolicyRun("vllm", "vllm",
                                             {"max_num_seqs": str(setup.max_num_seqs)})],
                            setup.rates, setup.seeds, out_dir, saturated=lambda *_: False,
                            executor=executor, variants=variants,
                            extra_metrics=conversation_metrics)
    by_key = {(p["variant"], float(p["rate"]), int(p["seed"])): p["summary"] for p in points}
    rows = []
    for key in keys:
        summary = by_key[key.variant, key.rate, key.seed]
        pool = variants[key.variant].limits.num_kv_pages
        rows.append({"setup": key.variant, "rate": key.rate, TTFT_MEAN: summary.get(TTFT_MEAN),
                     "ttft_p50_s": summary.get("ttft_p50_s"),
                     "ttft_p99_s": summary.get("ttft_p99_s"), PREFILL: summary.get(PREFILL),
                     "prefix_hit_rate": summary.get("prefix_hit_rate", 0.0),
                     "host_hit_tokens": summary.get("kv_tiers.host.hit_tokens", 0),
                     "disk_hit_tokens": summary.get("disk_hit_tokens", 0),
                     "stall_s": summary.get("kv_stall_s_total", 0.0),
                     "num_finished": summary.get("num_finished"),
                     "peak_held_pages": pool - summary.get("min_free_pages", 0)})
    for point in points:
        point["summary"][RATE] = point["rate"]
    return rows, aggregate(points, keys, RATE, TTFT_MEAN)


def paper_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per rate and setup with a cache: TTFT's reduction and prefill throughput's ratio
    against `recompute` at that rate, beside the paper's best."""
    base = {row["rate"]: row for row in rows if row["setup"] == BASELINE}
    out = []
    for row in rows:
        ref = base.get(row["rate"])
        if row["setup"] == BASELINE or ref is None:
            continue

        def cut(field: str) -> Optional[float]:
            if row[field] is None or not ref[field]:
                return None
            return round(1 - row[field] / ref[field], 3)

        out.append({"setup": row["setup"], "rate": row["rate"],
                    "ttft_mean_cut": cut(TTFT_MEAN), "ttft_p50_cut": cut("ttft_p50_s"),
                    "ttft_p99_cut": cut("ttft_p99_s"),
                    "prefill_speedup": (round(row[PREFILL] / ref[PREFILL], 2)
                                        if row[PREFILL] and ref[PREFILL] else None)})
    return out


FLAGS = reproduction_flags("cached_attention", FIGURE, CachedAttentionSetup)
flags.DEFINE_integer("device_pages", CachedAttentionSetup.device_pages, "the device KV pool "
                     "of every setup but the unbounded one, in pages of 16 tokens",
                     lower_bound=1, flag_values=FLAGS)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """The command: run every setup at every rate, print and write the tables and the figure.

    Args:
      argv: the flags (without the program name); None: the command line's.
    """
    args = parse_flags(FLAGS, argv)
    executor = executor_from_flags(args)
    setup = CachedAttentionSetup(num_requests=args.num_requests, rates=args.rates,
                                 device_pages=args.device_pages)
    os.makedirs(args.out_dir, exist_ok=True)
    start = time.perf_counter()
    rows, curves = run(setup, args.out_dir, executor)
    print(f"{setup.model} on {setup.tp} x {setup.hardware} (simulated), vllm; "
          f"{setup.num_requests} turns of conversations ({setup.num_turns} turns, message "
          f"{setup.message_len}, answer {setup.output_len}, think {setup.think_time_ms} ms) "
          f"per point; rate: conversations/s; device pool {setup.device_pages} pages of 16 "
          f"(every turn's KV at its end: {setup.history_pages()} pages, the host and disk "
          f"tiers' size; small host: {setup.small_host_share:g} of it); host link "
          f"{setup.host_link}, disk link {setup.disk_link}:")
    print(write_table(rows, COLUMNS, args.out_dir, "setups",
                      {"setup": dataclasses.asdict(setup)}))
    ours = paper_rows(rows)
    print(f"\npaper beside ours, against {BASELINE} at the same rate (CachedAttention: TTFT "
          f"down by up to {PAPER_TTFT_REDUCTION:.0%}, prefill throughput up to "
          f"{PAPER_PREFILL_SPEEDUP}x):")
    print(write_table(ours, ["setup", "rate", "ttft_mean_cut", "ttft_p50_cut", "ttft_p99_cut",
                             "prefill_speedup"], args.out_dir, "paper"))
    tiered = [r for r in ours if r["setup"] != "unbounded device"]
    best_cut = max((r["ttft_mean_cut"] for r in tiered if r["ttft_mean_cut"] is not None),
                   default=None)
    best_speedup = max((r["prefill_speedup"] for r in tiered
                        if r["prefill_speedup"] is not None), default=None)
    print(f"paper: TTFT down up to {PAPER_TTFT_REDUCTION:.0%}, prefill throughput up to "
          f"{PAPER_PREFILL_SPEEDUP}x; ours (best tiered setup over the rates): TTFT mean down "
          + (f"{best_cut:.0%}" if best_cut is not None else "-") + ", prefill throughput "
          + (f"{best_speedup:.2f}x" if best_speedup is not None else "-"))
    print(DIFFERS)
    # The legend names the setups (every curve is vllm's).
    curves = [dataclasses.replace(c, policy=c.variant, variant=None) for c in curves]
    write_figure_and_report(curves, args, figure_name=FIGURE, max_y=float("inf"),
                            x_field=RATE, y_field=TTFT_MEAN,
                            title=f"{setup.model}, {setup.tp} x {setup.hardware} (simulated): "
                                  "multi-turn TTFT by KV tier (x: conversations/s)",
                            tables=["setups", "paper"], start=start,
                            per_point=f"{args.num_requests} turns per point; rates "
                                      "{rates} conversations/s",
                            x_label="offered load (conversations/s)")


if __name__ == "__main__":
    run_app(main, FLAGS, __doc__)
