"""Replays a trace against a running server: `python -m experiments.bench_serve`.

    python -m experiments.bench_serve --url=http://127.0.0.1:8000 \
        --trace=../shared/traces/azure_conv_2023.csv --num_requests=200 \
        --trace_time_scale=4 --out_dir=/tmp/replay --server_dir=/tmp/serve_out

Each trace request is sent at its arrival time (times `--trace_time_scale`, as run's)
as a streaming `/v1/completions` call: the prompt is `prompt_len` repeated characters
(one token each under the byte tokenizer of the random-weight presets, so prompt lengths
match the trace), `max_tokens` is the trace's output length with `ignore_eos` (so output lengths
match too), greedy. The client records per request, on its own clock: TTFT (send to
first token), ITL (gaps between chunks carrying tokens), E2E, tokens and HTTP status.
It writes `--out_dir`: requests.jsonl (one row per request) and summary.json (p50, p90,
p99), and prints its percentiles beside the server's when `--server_dir` names the
server's results folder (written when the server gets SIGTERM; see
`benchmarks/serve_replay.py`, which does that). Needs httpx; imports no jax.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
import time
from typing import Optional, Sequence

import numpy as np
from absl import app, flags

from experiments.cli_errors import clean_errors, one_line, run_command

# Its own flags, not absl's global ones: a process that imports the run commands' flags
# (a test, a benchmark) can import this module too.
FLAGS = flags.FlagValues()
flags.DEFINE_string("url", "http://127.0.0.1:8000", "The server's base URL (no /v1).",
                    flag_values=FLAGS)
flags.DEFINE_string("model", "tiny", "The served model name.", flag_values=FLAGS)
flags.DEFINE_string("trace", None, "Trace file (CSV or JSON Lines, as --workload=trace).",
                    flag_values=FLAGS)
flags.DEFINE_integer("num_requests", None, "The first N requests of the trace (unset: all).",
                     lower_bound=1, flag_values=FLAGS)
flags.DEFINE_float("trace_time_scale", 1.0, "Multiplies every arrival time (4: a quarter of the "
                   "trace's rate).", lower_bound=0.0, flag_values=FLAGS)
flags.DEFINE_integer("max_model_len", None, "Context of the server: a request whose prompt "
                     "and output exceed it has its prompt cut to fit (counted in the "
                     "summary's num_prompts_cut); unset: the server's, from /v1/models; 0: "
                     "sent as the trace says (the server answers 400).", lower_bound=0,
                     flag_values=FLAGS)
flags.DEFINE_string("api_key", None, "Bearer key, if the server needs one.", flag_values=FLAGS)
flags.DEFINE_string("out_dir", None, "Folder for requests.jsonl and summary.json.",
                    flag_values=FLAGS)
flags.DEFINE_string("server_dir", None, "The server's results folder, to print its "
                    "summary beside the client's.", flag_values=FLAGS)
flags.DEFINE_string("write_trace", None, "Also write the requests as sent (arrivals scaled, "
                    "prompts cut) to this .jsonl trace: `experiments.run --workload=trace "
                    "--clock=wall` on it is the offline run of exactly this replay.",
                    flag_values=FLAGS)
flags.DEFINE_float("timeout_s", 600.0, "Per-request timeout.", lower_bound=0.0, flag_values=FLAGS)

PERCENTILES = (50, 90, 99)
# TPOT: a request's (E2E - TTFT) / (tokens - 1), the server summary's per-request mean gap.
METRICS = ("ttft_s", "tpot_s", "itl_s", "e2e_s")


@dataclasses.dataclass
class Planned:
    """One request to send: at `send_s` after the start, `prompt_len` tokens in."""

    id: int
    send_s: float
    prompt_len: int
    output_len: int
    cut: bool = False


@dataclasses.dataclass
class Outcome:
    """What the client saw of one request (times in seconds on the client's clock)."""

    id: int
    status: str  # "200", "429", "503", ... or "error: ..."
    send_s: float
    prompt_len: int
    max_tokens: int
    output_tokens: int = 0
    ttft_s: Optional[float] = None
    e2e_s: Optional[float] = None
    itl_s: list = dataclasses.field(default_factory=list)


def plan(requests: Sequence, time_scale: float, max_model_len: Optional[int]) -> list[Planned]:
    """The trace's requests as sends: arrivals times `time_scale`, prompts cut to fit."""
    out = []
    for rank, r in enumerate(requests):
        prompt, output = int(r.prompt_len), int(r.output_len)
        cut = max_model_len is not None and prompt + output > max_model_len
        if cut:
            output = min(output, max_model_len - 1)
            prompt = max_model_len - output
        out.append(Planned(rank, float(r.arrival_s) * time_scale, prompt, output, cut))
    return out


async def _one(client, url: str, model: str, p: Planned, start: float,
               headers: dict) -> Outcome:
    await asyncio.sleep(max(0.0, start + p.send_s - time.perf_counter()))
    body = {"model": model, "prompt": "a" * p.prompt_len, "max_tokens": p.output_len,
            "temperature": 0.0, "stream": True, "ignore_eos": True,
            "return_token_ids": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    out = Outcome(p.id, "", sent - start, p.prompt_len, p.output_len)
    last = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body,
                                 headers=headers) as resp:
            out.status = str(resp.status_code)
            if resp.status_code != 200:
                await resp.aread()
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                n = sum(len(c.get("token_ids") or ()) for c in chunk.get("choices", ()))
                if chunk.get("usage"):
                    out.output_tokens = chunk["usage"]["completion_tokens"]
                if n == 0:
                    continue
                now = time.perf_counter()
                if last is None:
                    out.ttft_s = now - sent
                else:
                    out.itl_s.append(now - last)
                out.itl_s.extend([0.0] * (n - 1))  # tokens of one chunk arrive together
                last = now
        out.e2e_s = time.perf_counter() - sent
    except Exception as e:  # a row for every request: the error is its status
        out.status = f"error: {type(e).__name__}: {e}"[:200]
    return out


async def replay(url: str, model: str, planned: Sequence[Planned], *,
                 api_key: Optional[str] = None, timeout_s: float = 600.0) -> list[Outcome]:
    """Sends every planned request at its time, concurrently; their outcomes in order."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        start = time.perf_counter()
        return list(await asyncio.gather(*(_one(client, url, model, p, start, headers)
                                           for p in planned)))


def served_max_model_len(url: str, model: str, api_key: Optional[str] = None
                         ) -> Optional[int]:
    """The context the server reports for `model` in /v1/models (None if it does not)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    for m in httpx.get(f"{url}/v1/models", headers=headers, timeout=30).json()["data"]:
        if m["id"] == model:
            return m.get("max_model_len")
    return None


def _pcts(values: Sequence[float]) -> dict:
    if not values:
        return {f"p{q}": None for q in PERCENTILES}
    return {f"p{q}": float(np.percentile(values, q)) for q in PERCENTILES}


def summarize(outcomes: Sequence[Outcome], planned: Sequence[Planned]) -> dict:
    """Counts by status and the p50/p90/p99 of TTFT, ITL, E2E over requests answered 200."""
    ok = [o for o in outcomes if o.status == "200" and o.e2e_s is not None]
    statuses: dict = {}
    for o in outcomes:
        key = o.status if not o.status.startswith("error") else "error"
        statuses[key] = statuses.get(key, 0) + 1
    span = max((o.send_s + (o.e2e_s or 0.0) for o in outcomes), default=0.0)
    tokens = sum(o.output_tokens for o in ok)
    return {"num_requests": len(outcomes), "statuses": statuses,
            "num_prompts_cut": sum(p.cut for p in planned),
            "num_short": sum(o.output_tokens != o.max_tokens for o in ok),
            "output_tokens": tokens, "duration_s": span,
            "output_tokens_per_s": tokens / span if span else None,
            "ttft_s": _pcts([o.ttft_s for o in ok if o.ttft_s is not None]),
            "tpot_s": _pcts([(o.e2e_s - o.ttft_s) / (o.output_tokens - 1) for o in ok
                             if o.ttft_s is not None and o.output_tokens > 1]),
            "itl_s": _pcts([g for o in ok for g in o.itl_s]),
            "e2e_s": _pcts([o.e2e_s for o in ok])}


def write_sent(path: str, planned: Sequence[Planned]) -> None:
    """The requests as sent, as a JSON Lines trace (`arrival_s`, `prompt_len`, `output_len`)."""
    with open(path, "w") as f:
        for p in planned:
            f.write(json.dumps({"id": p.id, "arrival_s": p.send_s, "prompt_len": p.prompt_len,
                                "output_len": p.output_len}) + "\n")


def write(out_dir: str, outcomes: Sequence[Outcome], summary: dict) -> None:
    """requests.jsonl (a row per request) and summary.json into `out_dir`."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "requests.jsonl"), "w") as f:
        for o in outcomes:
            f.write(json.dumps(dataclasses.asdict(o)) + "\n")
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)


# The server summary's name for each of `METRICS`: its E2E is `latency` (arrival at the
# engine thread to the last token).
SERVER_KEYS = {"ttft_s": "ttft", "tpot_s": "tpot", "itl_s": "itl", "e2e_s": "latency"}


def server_percentiles(server_dir: str) -> dict:
    """The server summary's percentiles of `METRICS` (None where it has none: the
    server's summary keeps only the p99 of ITL), in seconds."""
    with open(os.path.join(server_dir, "summary.json")) as f:
        s = json.load(f)
    return {m: {f"p{q}": s.get(f"{SERVER_KEYS[m]}_p{q}_s") for q in PERCENTILES}
            for m in METRICS}


def table(client: dict, server: Optional[dict], client_side: str = "client") -> str:
    """Client percentiles (ms) beside the server's, one line per metric; the client's
    lines are labelled `client_side`."""
    w = max(7, len(client_side))
    lines = [f"{'metric':8} {'side':{w}} " + " ".join(f"{'p' + str(q):>9}" for q in PERCENTILES)]
    for metric in METRICS:
        for side, d in ((client_side, client), ("server", server)):
            if d is None:
                continue
            vals = [d[metric].get(f"p{q}") for q in PERCENTILES]
            lines.append(f"{metric[:-2]:8} {side:{w}} " + " ".join(
                f"{v * 1e3:9.1f}" if isinstance(v, (int, float)) else f"{'-':>9}"
                for v in vals))
    return "\n".join(lines) + "\n(ms)"


@clean_errors()
def main(argv: list[str]) -> None:
    del argv
    if not FLAGS.trace:
        raise app.UsageError("--trace: give a trace file (e.g. ../shared/traces/"
                             "azure_conv_2023.csv)")
    if FLAGS.trace_time_scale <= 0:
        raise app.UsageError(f"--trace_time_scale={FLAGS.trace_time_scale}: must be > 0")
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    from orca_jax.workloads.traces import TraceError, load_trace
    try:
        requests = load_trace(FLAGS.trace, max_requests=FLAGS.num_requests)
    except (TraceError, OSError, ValueError) as e:
        raise app.UsageError(f"--trace={FLAGS.trace}: {e}") from None
    context = FLAGS.max_model_len
    if context is None:
        import httpx

        try:
            context = served_max_model_len(FLAGS.url.rstrip("/"), FLAGS.model, FLAGS.api_key)
        except (httpx.HTTPError, ValueError, KeyError) as e:
            raise app.UsageError(f"--url={FLAGS.url}: no server's /v1/models answers there "
                                 f"({type(e).__name__}: {e})") from None
    planned = plan(requests, FLAGS.trace_time_scale, context or None)
    if FLAGS.write_trace:
        write_sent(FLAGS.write_trace, planned)
    outcomes = asyncio.run(replay(FLAGS.url.rstrip("/"), FLAGS.model, planned,
                                  api_key=FLAGS.api_key, timeout_s=FLAGS.timeout_s))
    summary = summarize(outcomes, planned)
    if FLAGS.out_dir:
        write(FLAGS.out_dir, outcomes, summary)
    print(json.dumps({k: summary[k] for k in ("num_requests", "statuses", "num_prompts_cut",
                                              "num_short", "duration_s",
                                              "output_tokens_per_s")}))
    server = None
    if FLAGS.server_dir and os.path.isfile(os.path.join(FLAGS.server_dir, "summary.json")):
        server = server_percentiles(FLAGS.server_dir)
    print(table(summary, server))
    sys.stdout.flush()


def _parse(argv: list[str]) -> list[str]:
    """absl's parser for this command's own flags (`--help` lists them)."""
    if any(arg in ("-h", "-?", "--help", "--helpshort", "--helpfull") for arg in argv[1:]):
        print(f"{__doc__.strip()}\n\nflags:\n{FLAGS.get_help(include_special_flags=False)}")
        sys.exit(0)
    try:
        rest = FLAGS(argv)
    except flags.Error as e:
        print(one_line(e), file=sys.stderr)
        sys.exit(2)
    flags.FLAGS(argv[:1])  # absl's own flags keep their defaults
    return rest


if __name__ == "__main__":
    run_command(main, flags_parser=_parse)
