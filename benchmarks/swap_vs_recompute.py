"""Swap or recompute a preempted request: which is cheaper, over context length and link bandwidth.

Issue 27's crossover. A victim holding `L` computed tokens either swaps (its KV goes
down the host link and comes back up it when readmitted: `2 * (latency + L *
kv_bytes_per_token / bandwidth)`, what `SchedulerView.preemption_costs` prices) or
recomputes (its context's prefill runs again when readmitted, in chunks of the step
budget, `--chunk` tokens as `vllm`'s `max_num_tokens`, each priced by the simulator's
cost model alone on the GPU). Swap is cheaper above the crossover bandwidth

    B*(L) = 2 * L * kv_bytes_per_token / (recompute_s(L) - 2 * latency)

For each GPU (`--hardware`, default A100 and H100) and context length, this prints
the recompute seconds, the round-trip swap seconds over the PCIe 4, PCIe 5 and
NVLink-C2C presets (NVMe and RDMA beside them) and `B*`, then the winner over a sweep
of bandwidths, and draws `B*` against the context with the presets as lines
(`--figure`, default `docs/figures/swap_vs_recompute.png`).

    python -m benchmarks.swap_vs_recompute [--model llama3-8b llama2-7b] [--hardware a100 h100]

What it leaves out: the link's queue (other swaps ahead), a swap's overlap with steps
that do not need it (here the whole round trip is paid) and a recompute's sharing of
the weight reads with the decodes it is batched with (here each chunk is priced as a
step of its own, the recompute's standalone time: batched with decodes, a chunk costs
less and recompute wins over a wider range). Lengths past a model's context are
priced as if it had a longer one (`llama3.1-8b` is llama3-8b's network with 128k).
`llama2-7b` (full multi-head attention: 4x llama3-8b's KV a token) shows how grouped
query attention moved the crossover.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from orca_jax.sim.cost_model import CostModelConfig, roofline_seconds
from orca_jax.specs.hardware import get_kv_link
from orca_jax.specs.memory import kv_bytes_per_token

REPO = Path(__file__).resolve().parents[1]
PRESETS = ("pcie4", "pcie5", "nvlink-c2c")  # the three host links
ALSO = ("nvme", "rdma")  # slower tiers' links, for scale
CONTEXTS = tuple(2 ** k for k in range(7, 18))  # 128 .. 131072 tokens
SWEEP_GB_S = (1.0, 2.0, 4.0, 8.0, 16.0, 31.5, 63.0, 128.0, 450.0)


def recompute_s(config: CostModelConfig, context: int, chunk: int) -> float:
    """Seconds to prefill `context` tokens again, `chunk` tokens a step (each step alone)."""
    total, done = 0.0, 0
    while done < context:
        q = min(chunk, context - done)
        done += q
        total += roofline_seconds(config, np.array([q]), np.array([done]))
    return total


def swap_s(context: int, bytes_per_token: int, latency_s: float, bytes_per_s: float) -> float:
    """Seconds of a swap out and back in of `context` tokens' KV over one link, unqueued."""
    return 2.0 * (latency_s + context * bytes_per_token / bytes_per_s)


def crossover_bytes_per_s(context: int, bytes_per_token: int, recompute: float,
                          latency_s: float) -> float:
    """The bandwidth above which swapping `context` tokens is cheaper than recomputing."""
    spare = recompute - 2.0 * latency_s
    return math.inf if spare <= 0 else 2.0 * context * bytes_per_token / spare


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", default=["llama3-8b", "llama2-7b"],
                        help="models (llama2-7b: full multi-head KV, 4x llama3-8b's a token)")
    parser.add_argument("--hardware", nargs="+", default=["a100", "h100"])
    parser.add_argument("--chunk", type=int, default=2048, help="recompute tokens a step")
    parser.add_argument("--figure", default=str(REPO / "docs" / "figures" /
                                                "swap_vs_recompute.png"))
    parser.add_argument("--simulate", type=int, default=0, metavar="N",
                        help="also run vllm with swap and with recompute on N requests of a "
                             "KV-tight workload (llama3-8b on an H100) over a slow and a fast "
                             "host link")
    args = parser.parse_args(argv)
    links = {name: get_kv_link(name) for name in (*PRESETS, *ALSO)}
    curves: dict[str, tuple[list[int], list[float]]] = {}
    print(f"# recompute in chunks of {args.chunk} tokens, each step priced alone by the cost "
          "model (per_op); swap = out + in over one link, unqueued")
    for model, hardware in ((m, h) for m in args.model for h in args.hardware):
        config = CostModelConfig(model=model, hardware=hardware)
        per_token = kv_bytes_per_token(config.model_config)
        label = f"{model} on {config.hardware_spec.name}"
        print(f"\n## {label}: {per_token} KV bytes a token")
        header = ["context", "recompute_s"] + [f"swap_s@{n}" for n in links] + [
            "crossover_GB_s", "winner@" + "/".join(PRESETS)]
        print("  ".join(f"{h:>14}" for h in header))
        contexts, crossings = [], []
        for context in CONTEXTS:
            again = recompute_s(config, context, args.chunk)
            swaps = {n: swap_s(context, per_token, link.latency_s, link.bytes_per_s)
                     for n, link in links.items()}
            # Every preset's latency is a few microseconds: the crossover uses pcie4's.
            cross = crossover_bytes_per_s(context, per_token, again, links["pcie4"].latency_s)
            winners = "/".join("swap" if swaps[n] < again else "recompute" for n in PRESETS)
            row = [f"{context}", f"{again:.4g}", *(f"{swaps[n]:.4g}" for n in links),
                   f"{cross / 1e9:.3g}", winners]
            print("  ".join(f"{c:>14}" for c in row))
            contexts.append(context)
            crossings.append(cross / 1e9)
        curves[label] = (contexts, crossings)
        print(f"\n# winner over the sweep (rows: bandwidth GB/s, columns: context; "
              f"S swap, R recompute): {label}")
        print(f"{'GB/s':>7} " + " ".join(f"{c:>6}" for c in CONTEXTS))
        for gb_s in SWEEP_GB_S:
            marks = []
            for context, cross in zip(contexts, crossings):
                marks.append("S" if gb_s > cross else "R")
            print(f"{gb_s:>7g} " + " ".join(f"{m:>6}" for m in marks))
    if args.simulate:
        simulate(args.simulate)
    if args.figure:
        draw(curves, links, Path(args.figure), args.chunk)
        print(f"\nfigure: {args.figure}")
    return 0


def simulate(num_requests: int) -> None:
    """`vllm` preempting by swap and by recompute, host links either side of the crossover.

    llama3-8b on an H100, prompts of 1-4k tokens (crossover about 10 GB/s: NVMe's 7 GB/s
    is below it, PCIe 5 and NVLink-C2C above), a device pool of 600 pages (9,600 tokens:
    a few requests at once) and a host tier that holds every swapped request.
    """
    from orca_jax.runner.experiment import run_policy
    from orca_jax.runner.spec import LimitsSpec, RunSpec, SimEngineSpec, WorkloadSpec

    print(f"\n# simulator: vllm on llama3-8b/h100, {num_requests} requests, poisson 4 req/s, "
          "prompts uniform:1024:4096, outputs uniform:64:512, 600 device pages, 100,000 host "
          "pages")
    columns = ("host_link", "preemption_mode", "throughput_req_s", "latency_p50_s", "ttft_p50_s",
               "preemptions", "recomputed_tokens", "kv_stall_s_total")
    print("  ".join(f"{c:>17}" for c in columns))
    for link in ("nvme", "pcie5", "nvlink-c2c"):
        for mode in ("recompute", "swap"):
            spec = RunSpec(
                workload=WorkloadSpec(arrival="poisson", num_requests=num_requests, rate=4.0,
                                      prompt_len="uniform:1024:4096",
                                      output_len="uniform:64:512"),
                engine=SimEngineSpec(model="llama3-8b", hardware="h100"),
                limits=LimitsSpec(num_kv_pages=600, kv_host_pages=100_000,
                                  kv_host_link=link))
            summary, _ = run_policy(spec, "vllm", {"preemption_mode": mode}, progress=False)
            values = (link, mode, f"{summary['throughput_req_s']:.3f}",
                      f"{summary['latency_p50_s']:.2f}",
                      f"{summary['ttft_p50_s']:.2f}", f"{summary['num_preemptions']}",
                      f"{summary.get('recomputed_tokens', 0)}",
                      f"{summary.get('kv_stall_s_total', 0.0):.2f}")
            print("  ".join(f"{v:>17}" for v in values), flush=True)


def draw(curves: dict[str, tuple[list[int], list[float]]], links: dict, path: Path,
         chunk: int) -> None:
    """Crossover bandwidth against context, one line a model and GPU, the link presets
    across."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    styles = ("C0o-", "C3o-", "C0s--", "C3s--", "C2^-", "C4^-")
    for (name, (contexts, crossings)), style in zip(curves.items(), styles):
        ax.plot(contexts, crossings, style, label=name)
    for name, link in links.items():
        ax.axhline(link.bytes_per_s / 1e9, color="grey", linestyle=":" if name in ALSO
                   else "--", linewidth=1)
        above = 0.8 if name in ALSO else 1.07  # rdma's label sits under its line
        ax.text(CONTEXTS[0], link.bytes_per_s / 1e9 * above, f"{name} {link.bytes_per_s / 1e9:.3g}"
                " GB/s", fontsize=8, color="dimgrey", va="top" if above < 1 else "bottom")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context of the victim (tokens)")
    ax.set_ylabel("link bandwidth, one way (GB/s)")
    ax.set_title(f"Swap (out + in) is cheaper above a line, recompute ({chunk}-token prefill "
                 "chunks) below", fontsize=10)
    ax.set_ylim(0.5, 1000)
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(True, which="major", alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
