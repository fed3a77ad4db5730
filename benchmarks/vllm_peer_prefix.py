"""Prefix caching checked against vLLM 0.33's own scheduler, step by step.

A shared-prefix trace (`workloads.prefix_workloads.shared_prefix_workload`, written
with `write_trace`, token ids included) is run twice:

  * by vLLM's real v1 `Scheduler` with its prefix cache, under the peer venv's
    python (../shared/peers/vllm_scheduler/): once through the driver's own
    `drain --trace T --prefix-caching` command, whose JSON line gives vLLM's
    headline numbers, and once through this script re-run under that python
    (`--peer_side`), which repeats the driver's loop and logs each busy step;
  * by our scheduler with the `vllm` policy and prefix caching on, on the
    simulator with a fixed step time.

Both sides print busy steps, preemptions and saved tokens: the tokens never
computed thanks to the cache, net of recompute after preemption, computed the way
the driver does (expected tokens `sum(prompt + output - 1)` minus the tokens the
steps computed). The first busy step whose decisions differ is printed too.

    python benchmarks/vllm_peer_prefix.py [--peer_python=/tmp/vllm_peer/venv/bin/python]
        [--n=1000] [--rate=50] [--step_ms=20] [--num_blocks 200000 1000]

Settings are matched as `vllm_peer_compare.py` explains: vLLM's N blocks are our
N - 1 pages (block 0 is its null block); the driver turns an arrival at t seconds
into t * 1000 / step_ms scheduler calls and adds it before call ceil(that), its
clock ticking one call per idle step, so our side runs 1 s steps with each
arrival at ceil(t * 1000 / step_ms) s, and both clocks tick alike, exactly
(1 s stands for one `step_ms` step: decisions depend on the step count alone).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from typing import Any

# The sibling benchmark's step logs (this folder is on sys.path when a script here runs).
from vllm_peer_compare import Log, record_decisions, report_first_difference

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_PEER_DIR = os.path.normpath(os.path.join(HERE, os.pardir, os.pardir, "shared", "peers",
                                                 "vllm_scheduler"))
PAGE_SIZE = 16  # vLLM's default block size, and the driver's
VOCAB_SIZE = 32000  # the driver's fake model's vocabulary


def build_trace(path: str, args: argparse.Namespace) -> None:
    """Writes the shared-prefix workload as a JSON Lines trace with its token ids."""
    from orca_jax.workloads.prefix_workloads import shared_prefix_workload  # noqa: PLC0415
    from orca_jax.workloads.traces import write_trace  # noqa: PLC0415

    requests = shared_prefix_workload(
        num_requests=args.n, rate=args.rate, num_prefixes=args.num_prefixes,
        prefix_len=args.prefix_len, prefix_zipf=args.prefix_zipf, suffix_len=args.suffix_len,
        output_len=args.output_len, seed=args.seed, vocab_size=VOCAB_SIZE)
    write_trace(path, requests)


def run_peer_side(args: argparse.Namespace) -> None:
    """The driver's `drain` loop on the trace, logging each busy step (peer venv only)."""
    sys.path.insert(0, args.peer_dir)
    import drive_vllm_scheduler as peer  # noqa: PLC0415  (only importable in the peer venv)

    sched = peer.make_scheduler(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.mbt,
                                enable_chunked_prefill=True, max_model_len=args.max_model_len,
                                enable_prefix_caching=True, num_blocks=args.num_blocks)
    workload, arrivals, prompts = peer.read_trace(args.trace, args.step_ms)
    requests = [peer.make_request(i, p, o, prefix_caching=True, prompt=tokens)
                for i, ((p, o), tokens) in enumerate(zip(workload, prompts))]
    pool = sched.kv_cache_manager.block_pool
    evict = pool._maybe_evict_cached_block
    num_evictions = 0

    def counting_evict(block):  # noqa: ANN001, ANN202
        nonlocal num_evictions
        evicted = evict(block)
        num_evictions += evicted
        return evicted

    pool._maybe_evict_cached_block = counting_evict
    log: Log = []
    cached = [0] * len(requests)  # tokens each request's first admission took from the cache
    admitted: set[int] = set()  # a readmission after preemption is no prefix hit
    next_request, num_calls = 0, 0
    while next_request < len(requests) or sched.has_requests():
        while next_request < len(requests) and arrivals[next_request] <= num_calls:
            sched.add_request(requests[next_request])
            next_request += 1
        was_running = {r.request_id for r in sched.running}
        output, _, _, _ = peer.step(sched)
        num_calls += 1
        for rid, n in output.num_scheduled_tokens.items():
            if rid not in was_running and int(rid) not in admitted:  # first admitted now:
                admitted.add(int(rid))  # it starts past its hit
                cached[int(rid)] = requests[int(rid)].num_computed_tokens - n
        if output.total_num_scheduled_tokens:
            log.append({"tokens": {int(k): v for k, v in output.num_scheduled_tokens.items()},
                        "preempted": sorted(int(r) for r in output.preempted_req_ids or ())})
    with open(args.peer_out, "w") as f:
        json.dump({"log": log, "num_cached_tokens": cached, "num_evictions": num_evictions,
                   "num_preemptions": sum(r.num_preemptions for r in requests)}, f)


def run_our_side(args: argparse.Namespace) -> tuple[Log, dict[str, Any]]:
    """Our scheduler with the `vllm` policy and caching on; its step log and totals."""
    import dataclasses  # noqa: PLC0415

    import policies  # noqa: PLC0415
    from orca_jax import Scheduler  # noqa: PLC0415
    from orca_jax.results.summary import summarize  # noqa: PLC0415
    from orca_jax.runner.build import build_engine, scheduler_config  # noqa: PLC0415
    from orca_jax.runner.spec import LimitsSpec, RunSpec, SimEngineSpec, WorkloadSpec  # noqa: PLC0415
    from orca_jax.workloads.traces import load_trace  # noqa: PLC0415

    steps_per_s = 1000.0 / args.step_ms
    requests = [dataclasses.replace(r, arrival_s=float(math.ceil(r.arrival_s * steps_per_s)))
                for r in load_trace(args.trace)]
    spec = RunSpec(workload=WorkloadSpec(arrival="trace", trace=args.trace),
                   engine=SimEngineSpec(step_time_ms=1000.0),
                   limits=LimitsSpec(max_num_seqs=args.max_num_seqs, max_num_tokens=args.mbt,
                                     num_kv_pages=args.num_blocks - 1, page_size=PAGE_SIZE,
                                     max_model_len=args.max_model_len))
    policy = policies.make_policy("vllm", {
        "max_num_seqs": str(args.max_num_seqs), "max_num_tokens": str(args.mbt),
        "enable_chunked_prefill": "True", "enable_prefix_caching": "True"})
    config = scheduler_config(spec)
    scheduler = Scheduler(requests, policy, build_engine(spec, config), config)
    log = record_decisions(scheduler)
    result = scheduler.run()
    summary = summarize(result)
    totals = {"num_preemptions": result.total_preemptions,
              "num_cached_tokens": dict(zip(result.request_ids,
                                            result.num_cached_tokens.tolist())),
              "prefix_hit_rate": summary.get("prefix_hit_rate"),
              "num_evictions": summary.get("num_evictions"),
              "all_done": bool((result.num_generated == result.output_len).all())}
    return log, totals


def relative_gap(ours: float, theirs: float) -> str:
    return f"{100 * (ours - theirs) / theirs:+.2f}%" if theirs else "n/a"


def compare(args: argparse.Namespace, num_blocks: int) -> None:
    """Runs both sides on the trace with `num_blocks` vLLM blocks and prints the comparison."""
    args = argparse.Namespace(**vars(args), num_blocks=num_blocks)
    peer_env = dict(os.environ, PYTHONPATH="")
    drain_command = [args.peer_python, os.path.join(args.peer_dir, "drive_vllm_scheduler.py"),
                     "drain", "--trace", args.trace, "--prefix-caching",
                     "--step-ms", f"{args.step_ms:g}", "--num-blocks", str(num_blocks),
                     "--max-model-len", str(args.max_model_len), "--mbt", str(args.mbt),
                     "--max-num-seqs", str(args.max_num_seqs)]
    print("$ " + " ".join(drain_command))
    drain_out = subprocess.run(drain_command, check=True, env=peer_env, capture_output=True,
                               text=True).stdout.strip().splitlines()[-1]
    print(drain_out)
    drain = json.loads(drain_out)
    args.peer_out = os.path.join(os.path.dirname(args.trace), f"peer_{num_blocks}.json")
    log_command = [args.peer_python, os.path.abspath(__file__), "--peer_side",
                   f"--peer_out={args.peer_out}", f"--trace={args.trace}",
                   f"--peer_dir={args.peer_dir}", f"--step_ms={args.step_ms:g}",
                   f"--num_blocks={num_blocks}", f"--mbt={args.mbt}",
                   f"--max_num_seqs={args.max_num_seqs}", f"--max_model_len={args.max_model_len}"]
    subprocess.run(log_command, check=True, env=peer_env, stdout=subprocess.DEVNULL)
    with open(args.peer_out) as f:
        peer = json.load(f)
    peer_log: Log = [{"tokens": {int(k): v for k, v in s["tokens"].items()},
                      "preempted": s["preempted"]} for s in peer["log"]]
    ours, totals = run_our_side(args)

    expected = drain["expected_tokens"]
    our_tokens = sum(sum(s["tokens"].values()) for s in ours)
    peer_tokens = sum(sum(s["tokens"].values()) for s in peer_log)
    our_saved, peer_saved = expected - our_tokens, drain["saved_tokens"]
    print(f"vLLM blocks={num_blocks} (our pages={num_blocks - 1}), page 16, "
          f"max_num_seqs={args.max_num_seqs} max_num_batched_tokens={args.mbt} "
          f"max_model_len={args.max_model_len}, chunked prefill, step {args.step_ms:g} ms")
    print(f"  busy steps:   ours {len(ours)}, vLLM {drain['busy_steps']} "
          f"({relative_gap(len(ours), drain['busy_steps'])}); vLLM step log {len(peer_log)}")
    print(f"  preemptions:  ours {totals['num_preemptions']}, vLLM {drain['num_preemptions']}")
    print(f"  saved tokens: ours {our_saved}, vLLM {peer_saved} "
          f"({relative_gap(our_saved, peer_saved)}) of {drain['prompt_tokens']} prompt tokens; "
          f"vLLM step log {expected - peer_tokens}")
    peer_cached = peer["num_cached_tokens"]
    our_cached = totals["num_cached_tokens"]
    print(f"  first-admission cache hits: ours {sum(our_cached.values())} tokens "
          f"(prefix_hit_rate {totals['prefix_hit_rate']:.4f}), vLLM {sum(peer_cached)} "
          f"({sum(peer_cached) / drain['prompt_tokens']:.4f}); evictions: ours "
          f"{totals['num_evictions']}, vLLM {peer['num_evictions']}; all outputs done: ours "
          f"{totals['all_done']}, vLLM {drain['all_done'] and drain['out_tokens_ok']}")
    k = report_first_difference(ours, peer_log, indent="  ")
    if k is not None:
        ids = sorted(set(ours[k]["tokens"]) ^ set(peer_log[k]["tokens"])
                     | {r for r, n in ours[k]["tokens"].items()
                        if peer_log[k]["tokens"].get(r) != n})[:8]
        print("    cache hits of those requests at their first admission (ours/vLLM): "
              + ", ".join(f"{r}: {our_cached.get(r)}/{peer_cached[r]}" for r in ids))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer_python", default="/tmp/vllm_peer/venv/bin/python")
    parser.add_argument("--peer_dir", default=DEFAULT_PEER_DIR)
    parser.add_argument("--n", type=int, default=1000, help="requests")
    parser.add_argument("--rate", type=float, default=50.0, help="requests per second")
    parser.add_argument("--num_prefixes", type=int, default=8)
    parser.add_argument("--prefix_len", default="uniform:200:1000",
                        help="system prompt lengths (not whole pages, so partial pages occur)")
    parser.add_argument("--prefix_zipf", type=float, default=1.1)
    parser.add_argument("--suffix_len", default="uniform:16:256")
    parser.add_argument("--output_len", default="uniform:1:128")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step_ms", type=float, default=20.0, help="milliseconds per step")
    parser.add_argument("--mbt", type=int, default=2048, help="max_num_batched_tokens")
    parser.add_argument("--max_num_seqs", type=int, default=256)
    parser.add_argument("--max_model_len", type=int, default=2048)
    parser.add_argument("--num_blocks", type=int, nargs="+", default=[200_000, 1000],
                        help="vLLM KV blocks of 16 tokens, one comparison each")
    parser.add_argument("--trace", help="use this trace instead of building one")
    parser.add_argument("--peer_side", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--peer_out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer_side:
        args.num_blocks = args.num_blocks[0]
        run_peer_side(args)
        return
    if not os.path.isfile(args.peer_python):
        parser.error(f"--peer_python={args.peer_python}: no such file (set the peer venv up with "
                     "../shared/peers/vllm_scheduler/setup_min_venv.sh)")
    if not os.path.isfile(os.path.join(args.peer_dir, "drive_vllm_scheduler.py")):
        parser.error(f"--peer_dir={args.peer_dir}: has no drive_vllm_scheduler.py")
    all_blocks = args.num_blocks
    del args.num_blocks
    with tempfile.TemporaryDirectory() as tmp:
        if args.trace is None:
            args.trace = os.path.join(tmp, "shared_prefix.jsonl")
            build_trace(args.trace, args)
            print(f"trace: shared_prefix n={args.n} rate={args.rate:g}/s "
                  f"num_prefixes={args.num_prefixes} prefix_len={args.prefix_len} "
                  f"prefix_zipf={args.prefix_zipf:g} suffix_len={args.suffix_len} "
                  f"output_len={args.output_len} seed={args.seed} vocab={VOCAB_SIZE}")
        for num_blocks in all_blocks:
            compare(args, num_blocks)


if __name__ == "__main__":
    main()
