"""Serves one policy over HTTP: `python -m experiments.serve --policy=orca --model=tiny`.

An OpenAI-compatible server (`orca_jax.serving.app`: /v1/completions,
/v1/chat/completions, /v1/models, /health, /metrics) on the same scheduler, policy
and compiled steps as `experiments.run`, with run's flags (policy and its options,
model, checkpoint, engine limits, attention, compile cache, tp). The engine runs on
the wall clock (`--clock` is set to wall); the requests are the clients', so a
workload flag or a cluster flag (more than one replica) is refused, as is a port in
use or a host that does not resolve, in one line before the engine compiles. SIGTERM
(or Ctrl-C) answers new requests 503 while those held finish, then writes --out_dir
as an offline run does (config.json, requests.jsonl, steps.jsonl, summary.json),
releases its lock and exits 0. Needs the `serve` extra.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys

from absl import app as absl_app
from absl import flags

import policies
from experiments import flags as run_flags
from experiments.list_flags import registered_names
from experiments.process_exit import without_final_collection
from orca_jax.core.api.policy import make_policy
from orca_jax.results.folder_lock import run_lock
from orca_jax.results.run_folder import RunFolder, check_out_dir
from orca_jax.results.summary import flatten, summarize_run
from orca_jax.runner.bucket_pilot import needs_fit
from orca_jax.runner.build import (
    build_engine,
    check_policies,
    max_model_len,
    model_config,
    scheduler_config,
)
from orca_jax.runner.experiment import finish_run_folder, resolved_config  # as run writes them
from orca_jax.runner.spec import ClusterSpec, RunSpec, WorkloadSpec

flags.adopt_module_key_flags(run_flags)
flags.DEFINE_string("policy", "orca", "Policy: a registered name, package.module:Class, or "
                    "path/to/file.py:Class. " + registered_names("policies"))
flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (loopback only by default; "
                    "0.0.0.0 for every interface).")
flags.DEFINE_integer("port", 8000, "Port to listen on.", lower_bound=1, upper_bound=65535)
flags.DEFINE_string("api_key", None, "If set, the /v1 routes need `Authorization: Bearer "
                    "KEY` (default: $ORCA_JAX_API_KEY if set, else no key).")
flags.DEFINE_string("served_model_name", None, "The model's name in the API (default: "
                    "--model).")
flags.DEFINE_string("tokenizer", None, "Folder with tokenizer.json (and tokenizer_config.json"
                    "); default: --checkpoint's, else the built-in byte tokenizer (token id "
                    "= UTF-8 byte) for a random-weight preset.")
flags.DEFINE_integer("max_requests", 100_000, "Requests served over the server's life (rows "
                     "of its request table, about 300 bytes each); then 503.", lower_bound=1)
flags.DEFINE_integer("max_queued", 256, "Requests held beyond --max_num_seqs (waiting for a "
                     "batch place); one more is answered 429.", lower_bound=0)


def _tokenizer_folder(spec: RunSpec) -> str | None:
    if run_flags.FLAGS.tokenizer:
        return run_flags.FLAGS.tokenizer
    checkpoint = getattr(spec.engine, "checkpoint", None)
    if checkpoint and os.path.isfile(os.path.join(checkpoint, "tokenizer.json")):
        return checkpoint
    return None


def _given(part: type, *, unless_default: bool = False) -> list[str]:
    """The flags given of `part`'s fields, as `--flag=value` (`unless_default`: only those
    given another value than their default)."""
    FLAGS = run_flags.FLAGS
    return [f"--{flag}={FLAGS[flag].value}" for flag, fields in run_flags.FIELD_FLAGS.items()
            if FLAGS[flag].present and any(owner is part for owner, _ in fields)
            and not (unless_default and FLAGS[flag].value == FLAGS[flag].default)]


def _check_servable() -> None:
    """Refuses, in one line, the flags a server does not read: its requests are its
    clients' (no workload flag at all) and it runs one replica (no cluster flag set to
    anything but its default)."""
    workload = _given(WorkloadSpec)
    if workload:
        raise absl_app.UsageError(f"{' '.join(workload)}: serve takes its requests from its "
                                  "clients and reads no workload flag; drop it (to replay a "
                                  "trace against the server: experiments.bench_serve)")
    cluster = _given(ClusterSpec, unless_default=True)
    if cluster:
        raise absl_app.UsageError(f"{' '.join(cluster)}: serve runs one replica; the cluster "
                                  "flags are experiments.run's")


@run_flags.clean_errors()
def main(argv: list[str]) -> None:
    del argv
    FLAGS = run_flags.FLAGS
    try:
        import uvicorn

        from orca_jax.serving.app import create_app
        from orca_jax.serving.live import LiveRun
        from orca_jax.serving.metrics import ServingMetrics
        from orca_jax.serving.server import DrainingServer, bind_listener
        from orca_jax.serving.tokenizer import load_tokenizer
    except ImportError as e:
        raise absl_app.UsageError(f"serve needs the serve extra (pip install -e \".[serve]\"): "
                                  f"{e}") from None
    _check_servable()
    spec = run_flags.spec_from_flags()
    if spec.engine.kind != "jax":
        raise absl_app.UsageError(f"--engine={spec.engine.kind}: serve runs the jax engine "
                                  "(the answers are its tokens)")
    if needs_fit(spec):
        raise absl_app.UsageError("--bucket_ladder fit:K fits a workload's steps; a server has "
                                  "none: give --buckets or another --bucket_ladder")
    spec = dataclasses.replace(spec, engine=dataclasses.replace(spec.engine, clock="wall"))
    options = policies.parse_options(FLAGS.policy_opts)
    config = scheduler_config(spec)
    check_policies(spec, config, [(FLAGS.policy, options)])
    out_dir, fresh = run_flags.results_folder("serve")
    check_out_dir(out_dir)
    try:
        tokenizer = load_tokenizer(_tokenizer_folder(spec), model_config(spec).vocab_size)
    except ValueError as e:
        raise absl_app.UsageError(str(e)) from None
    api_key = FLAGS.api_key or os.environ.get("ORCA_JAX_API_KEY") or None
    try:  # the port, before minutes of compiling: in use, it is one line and nothing written
        listener = bind_listener(FLAGS.host, FLAGS.port)
    except ValueError as e:
        raise absl_app.UsageError(str(e)) from None
    with listener, run_lock(out_dir):
        policy = make_policy(FLAGS.policy, options)
        engine = build_engine(spec, config)
        metrics = ServingMetrics()
        live = LiveRun(policy, engine, config, capacity=FLAGS.max_requests,
                       max_outstanding=config.limits.max_num_seqs + FLAGS.max_queued,
                       metrics=metrics)
        folder = RunFolder(out_dir, label=policy.name)
        written: list[bool] = []  # on_shutdown's mark: the results are in the folder
        try:
            folder.begin(resolved_config(spec, FLAGS.policy, policy, config, engine,
                                         policy.name), stream=False)
            print(f"serve: compiling the engine's steps ({spec.engine.model})", flush=True)
            live.start()
        except BaseException:
            folder.discard()  # nothing was served: no results folder, not an empty one
            raise

        def on_shutdown() -> None:
            print(f"serve: draining {live.num_outstanding} requests", flush=True)
            live.drain()
            result = live.result()
            summary, tables = summarize_run(result, ttft_slo_s=spec.ttft_slo_s,
                                            tpot_slo_s=spec.tpot_slo_s)
            summary.update(flatten(engine.facts()))
            summary["policy"] = policy.name
            finish_run_folder(folder, result, summary, tables, write_steps=True)
            written.append(True)
            print(f"serve: {result.num_requests} requests; results in {out_dir}", flush=True)

        name = FLAGS.served_model_name or spec.engine.model
        server_app = create_app(live, tokenizer, model_name=name,
                                max_model_len=max_model_len(spec),
                                vocab_size=model_config(spec).vocab_size, api_key=api_key,
                                metrics=metrics, on_shutdown=on_shutdown)
        print(f"serve: {policy.name} as model {name!r} on http://{FLAGS.host}:{FLAGS.port}/v1",
              flush=True)
        server = DrainingServer(uvicorn.Config(server_app, host=FLAGS.host, port=FLAGS.port,
                                               log_level="warning", lifespan="on"), live)
        try:
            server.run(sockets=[listener])
        finally:
            if not written:  # the server never started (or died before its shutdown)
                live.drain(timeout_s=0)
                folder.discard()
    # Here the lock is released and the results written: a stop signal ends the command
    # with exit status 0, as a stop asked for.
    run_flags.link_latest(out_dir, fresh)
    if server.signals:
        print(f"serve: stopped by {signal.Signals(server.signals[0]).name}", flush=True)
    if live.error is not None:
        print(f"error: the engine failed: {live.error}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    run_flags.run_command(without_final_collection(main))
