"""Step-by-step comparison of the `vllm` policy with vLLM 0.33's own v1 scheduler.

Two processes: this script, under the project's python, runs our scheduler
(SimEngine, fixed 1 s steps) with the `vllm` policy; it re-runs itself under
the peer venv's python (`--peer_python`, see ../shared/peers/vllm_scheduler/)
to drive vLLM's real `Scheduler` on the same workload (the peer's own
`gen_workload`: prompts U[32,512], outputs U[1,128], seed 0). Each side logs,
per busy step, `{request id: tokens}` and the preempted ids; the peer side
hands its log back as JSON. The script prints both step counts and the first
step where the decisions differ (or that none does).

    python benchmarks/vllm_peer_compare.py --peer_python=/tmp/vllm_peer/venv/bin/python \
        [--mbt=2048] [--num_blocks=200000] [--no_chunked] [--poisson=2] [--priority_levels=4]

vLLM's pool of N blocks has N - 1 usable ones (block 0 is its null block), so
our side runs with N - 1 KV pages. Peer arrivals are in scheduler calls: the
driver adds a request arriving at t (a real number of steps) before call
ceil(t), and its clock ticks one call per idle step; ours would start the first
step at t itself. So our side gets each arrival at ceil(t) steps, which makes
both clocks agree (with arrivals at t ms instead, ours runs its steps at
0.3, 1.3, ... ms, admits later than vLLM, and the logs part at step 1).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
from typing import Any, Optional

DEFAULT_PEER_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir,
                                "shared", "peers", "vllm_scheduler")
Log = list[dict[str, Any]]  # per busy step: {"tokens": {id: n}, "preempted": [ids]}


def run_peer_side(args: argparse.Namespace) -> None:
    """Drives vLLM's Scheduler (runs under the peer venv) and writes its log as JSON."""
    sys.path.insert(0, args.peer_dir)
    import drive_vllm_scheduler as peer  # noqa: PLC0415  (only importable in the peer venv)

    sched = peer.make_scheduler(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.mbt,
                                enable_chunked_prefill=not args.no_chunked,
                                max_model_len=args.max_model_len, num_blocks=args.num_blocks,
                                policy="priority" if args.priority_levels else "fcfs",
                                long_prefill_token_threshold=args.long_prefill)
    workload = peer.gen_workload(args.n, 0)
    arrivals = peer.gen_arrivals(args.n, 0, args.poisson)
    rng = random.Random(7)
    priorities = [rng.randrange(args.priority_levels) if args.priority_levels else 0
                  for _ in range(args.n)]
    requests = [peer.make_request(i, p, o) for i, (p, o) in enumerate(workload)]
    for request, priority in zip(requests, priorities):
        request.priority = priority
    log: Log = []
    next_request, num_calls = 0, 0
    while next_request < args.n or sched.has_requests():
        while next_request < args.n and arrivals[next_request] <= num_calls:
            sched.add_request(requests[next_request])
            next_request += 1
        output, _, _, _ = peer.step(sched)
        num_calls += 1
        if output.total_num_scheduled_tokens:
            log.append({"tokens": {int(k): v for k, v in output.num_scheduled_tokens.items()},
                        "preempted": sorted(int(r) for r in output.preempted_req_ids or ())})
    with open(args.peer_out, "w") as f:
        json.dump({"workload": workload, "arrivals": arrivals, "priorities": priorities,
                   "log": log}, f)


def run_our_side(args: argparse.Namespace, workload: list[list[int]], arrivals: list[float],
                 priorities: list[int]) -> tuple[Log, int]:
    """Runs our scheduler with the `vllm` policy; returns its step log and preemptions."""

    import policies  # noqa: PLC0415
    from orca_jax import Request, Scheduler  # noqa: PLC0415
    from orca_jax.runner.build import build_engine, scheduler_config  # noqa: PLC0415
    from orca_jax.runner.spec import LimitsSpec, RunSpec, SimEngineSpec, WorkloadSpec  # noqa: PLC0415

    # One step = 1 s, and an arrival at t steps lands on the step vLLM's driver first sees
    # it (call ceil(t)): both clocks then tick alike, idle steps included, and exactly.
    requests = [Request(id=i, arrival_s=float(math.ceil(t)), prompt_len=p, output_len=o,
                        priority=priority)
                for i, ((p, o), t, priority) in enumerate(zip(workload, arrivals, priorities))]
    spec = RunSpec(workload=WorkloadSpec(arrival="burst", num_requests=args.n),
                   engine=SimEngineSpec(step_time_ms=1000.0),
                   limits=LimitsSpec(max_num_seqs=args.max_num_seqs, max_num_tokens=args.mbt,
                                     num_kv_pages=args.num_blocks - 1, page_size=16,
                                     max_model_len=args.max_model_len))
    policy = policies.make_policy(
        "vllm-priority" if args.priority_levels else "vllm",
        {"max_num_seqs": str(args.max_num_seqs), "max_num_tokens": str(args.mbt),
         "enable_chunked_prefill": str(not args.no_chunked),
         "long_prefill_token_threshold": str(args.long_prefill)})
    config = scheduler_config(spec)
    scheduler = Scheduler(requests, policy, build_engine(spec, config), config)
    log = record_decisions(scheduler)
    return log, scheduler.run().total_preemptions


def record_decisions(scheduler: Any) -> Log:
    """Wraps the scheduler's policy so each busy step's plan is logged, by request id."""
    import numpy as np  # noqa: PLC0415  (the peer venv side never calls this)

    policy = scheduler.policy
    ids = np.array([spec.id for spec in scheduler.table.specs])
    log: Log = []
    decide = policy.schedule

    def recording_schedule(view):  # noqa: ANN001, ANN202
        plan = decide(view)
        if plan.request_ids.size:
            log.append({"tokens": dict(zip(ids[plan.request_ids].tolist(),
                                           plan.num_tokens.tolist())),
                        "preempted": sorted(ids[plan.preempt].tolist())})
        return plan

    policy.schedule = recording_schedule  # type: ignore[method-assign]
    return log


def describe(step: dict[str, Any], limit: int = 12) -> str:
    items = sorted(step["tokens"].items())
    text = ", ".join(f"{k}:{v}" for k, v in items[:limit])
    more = f", ... ({len(items)} requests)" if len(items) > limit else ""
    return f"{{{text}{more}}} preempted={step['preempted']}"


def first_difference(ours: Log, peer: Log) -> tuple[int, str] | None:
    """Index of the first busy step whose decisions differ, and how; None if none does."""
    for k, (a, b) in enumerate(zip(ours, peer)):
        if a["tokens"] != b["tokens"] or a["preempted"] != b["preempted"]:
            only_ours = {r: n for r, n in a["tokens"].items() if b["tokens"].get(r) != n}
            only_peer = {r: n for r, n in b["tokens"].items() if a["tokens"].get(r) != n}
            return k, (f"ours only/different: {dict(sorted(only_ours.items()))}; "
                       f"vLLM only/different: {dict(sorted(only_peer.items()))}; "
                       f"preempted ours {a['preempted']} vs vLLM {b['preempted']}")
    if len(ours) != len(peer):
        return min(len(ours), len(peer)), "one side ran out of steps"
    return None


def report_first_difference(ours: Log, peer: Log, indent: str = "") -> Optional[int]:
    """Prints whether the two step logs agree, or their first differing busy step (and
    returns its index, when both sides ran it)."""
    difference = first_difference(ours, peer)
    if difference is None:
        print(f"{indent}per-step decisions: identical in all {len(ours)} busy steps "
              "(same requests, same token counts, same preemptions)")
        return None
    k, how = difference
    print(f"{indent}per-step decisions: first difference at busy step {k}: {how}")
    if k >= min(len(ours), len(peer)):
        return None
    print(f"{indent}  ours: {describe(ours[k])}\n{indent}  vLLM: {describe(peer[k])}")
    return k


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer_python", default="/tmp/vllm_peer/venv/bin/python")
    parser.add_argument("--peer_dir", default=os.path.normpath(DEFAULT_PEER_DIR))
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--mbt", type=int, default=2048, help="max_num_batched_tokens")
    parser.add_argument("--max_num_seqs", type=int, default=256)
    parser.add_argument("--max_model_len", type=int, default=2048)
    parser.add_argument("--num_blocks", type=int, default=200_000, help="vLLM KV blocks of 16")
    parser.add_argument("--no_chunked", action="store_true")
    parser.add_argument("--poisson", type=float, default=None, help="arrivals per step")
    parser.add_argument("--long_prefill", type=int, default=0,
                        help="long_prefill_token_threshold (0: off)")
    parser.add_argument("--priority_levels", type=int, default=0,
                        help="> 0: priority scheduling, priorities U{0..K-1} (seed 7)")
    parser.add_argument("--peer_side", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--peer_out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer_side:
        run_peer_side(args)
        return
    if not os.path.isfile(args.peer_python):
        parser.error(f"--peer_python={args.peer_python}: no such file (set the peer venv up with "
                     "../shared/peers/vllm_scheduler/setup_min_venv.sh)")
    if not os.path.isfile(os.path.join(args.peer_dir, "drive_vllm_scheduler.py")):
        parser.error(f"--peer_dir={args.peer_dir}: has no drive_vllm_scheduler.py")
    with tempfile.TemporaryDirectory() as tmp:
        args.peer_out = os.path.join(tmp, "peer.json")
        command = [args.peer_python, os.path.abspath(__file__), "--peer_side",
                   "--peer_out", args.peer_out] + sys.argv[1:]
        env = dict(os.environ, PYTHONPATH="")
        subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
        with open(args.peer_out) as f:
            peer = json.load(f)
    peer_log: Log = [{"tokens": {int(k): v for k, v in s["tokens"].items()},
                      "preempted": s["preempted"]} for s in peer["log"]]
    ours, our_preemptions = run_our_side(args, peer["workload"], peer["arrivals"],
                                         peer["priorities"])
    peer_preemptions = sum(len(s["preempted"]) for s in peer_log)
    print(f"workload: {args.n} requests, prompt U[32,512], output U[1,128], seed 0, "
          f"{'Poisson %g/step' % args.poisson if args.poisson else 'all at t=0'}; "
          f"max_num_seqs={args.max_num_seqs} max_num_batched_tokens={args.mbt} "
          f"chunked_prefill={not args.no_chunked} priority_levels={args.priority_levels} "
          f"long_prefill={args.long_prefill} "
          f"vLLM blocks={args.num_blocks} "
          f"(our pages={args.num_blocks - 1})")
    print(f"busy steps: ours {len(ours)}, vLLM {len(peer_log)}; "
          f"preemptions: ours {our_preemptions}, vLLM {peer_preemptions}")
    report_first_difference(ours, peer_log)


if __name__ == "__main__":
    main()
