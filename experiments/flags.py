"""The run-plumbing flags shared by experiments.run, .compare and .sweep.

Flags are plumbing only (engine, model, workload, limits, output); experiment
knobs live on policies (`--policy_opts`). `spec_from_flags()` resolves them into
an `orca_jax.runner.spec.RunSpec`. The flags renamed in 0.2 (`--max_batch_size`,
`--token_budget`) still set their new flags, with a warning line.
"""

from __future__ import annotations

import re
import sys
import warnings
from typing import Optional

from absl import app, flags

from experiments.cli_errors import clean_errors, parse_flags  # noqa: F401 (entry points' API)
from orca_jax.core.bucket_fit import parse_fit_ladder
from orca_jax.core.packing import ladder_token_sizes
from orca_jax.runner.spec import (
    ATTENTIONS,
    CLOCKS,
    DTYPES,
    ENGINES,
    LENGTH_COLUMNS,
    WORKLOADS,
    ClusterSpec,
    JaxEngineSpec,
    LimitsSpec,
    RunSpec,
    SimEngineSpec,
    WorkloadSpec,
)
from orca_jax.workloads.synthetic import parse_length_spec

# Python hides a DeprecationWarning raised outside __main__; a command shows the library's
# own (an old policy option name, an old view attribute a plugin reads), once each.
warnings.filterwarnings("default", message=r".* is deprecated; use ", category=DeprecationWarning)

flags.DEFINE_enum("engine", "jax", list(ENGINES), "Engine: the real JAX model (jax) or the "
                  "cost-model simulator (sim).")
flags.DEFINE_string("model", None, "Model preset. jax: tiny, small, llama3-8b, llama2-7b; sim: "
                    "llama3-8b, llama2-7b, mistral-7b, opt-13b, gpt3-175b, tiny, small. "
                    "Default: tiny on jax, llama3-8b on sim.")
flags.DEFINE_string("checkpoint", None, "jax: an orbax checkpoint directory or a LLaMA-format "
                    "folder (config.json + *.safetensors); default: seeded random weights.")
flags.DEFINE_enum("dtype", "float32", list(DTYPES), "jax: parameter, activation and KV dtype.")
flags.DEFINE_enum("attention", "auto", list(ATTENTIONS), "jax: attention op (auto: the Pallas "
                  "kernel on a GPU, bucketed (all queries at once, KV chunks up to the step's "
                  "longest context) elsewhere; reference: the ragged jnp loop, the kernel's "
                  "oracle; pallas off a GPU runs the kernel in interpret mode).")
flags.DEFINE_string("sampling", "greedy", "jax: greedy, or temperature:T[:TOP_K[:TOP_P]].")
flags.DEFINE_enum("clock", "profiled", list(CLOCKS), "jax: advance the virtual clock by "
                  "each bucket's warm-up median (repeatable) or by measured wall time.")
# Not --profile_file: absl.app owns that name (a pstats dump of the process).
flags.DEFINE_string("compile_cache", None, "jax: folder of JAX's persistent compilation cache "
                    "(default: $XDG_CACHE_HOME/orca_jax/jax, else ~/.cache/orca_jax/jax); a "
                    "second run with the same model and buckets loads its compiled steps from "
                    "there. 'none' turns it off.")
flags.DEFINE_string("profile_table", None, "jax, --clock=profiled: the per-bucket table of the "
                    "profiled clock. If the file exists it is read (it must be of the same "
                    "model, buckets, dtype, attention and page geometry), so a run in another "
                    "process repeats this one's timings bit for bit; if not, the table is "
                    "measured and written there. Default: measured, and written to "
                    "profile.json in --out_dir. config.json names the table and its sha256.")
flags.DEFINE_string("hardware", "a100", "Hardware preset of the simulator: a100 (80GB), a100-40gb, "
                    "h100, h200.")
flags.DEFINE_integer("tp", 1, "Tensor-parallel degree: of the simulated replica (sim), or the "
                     "number of local devices the jax engine splits weights, KV cache and "
                     "attention over.", lower_bound=1)
flags.DEFINE_bool("overlap", True, "jax: plan and pack step N+1 while step N runs on the "
                  "device (its decodes read N's sampled tokens there; N's tokens come back one "
                  "step late). Plans, steps and tokens are the same with it off; not active "
                  "with prefix caching.")
flags.DEFINE_integer("num_processes", 1, "jax: processes of one run (jax.distributed); the "
                     "--tp mesh spans their devices and every process runs the same steps. "
                     "Every process gets the same flags but --process_id.", lower_bound=1)
flags.DEFINE_integer("process_id", 0, "jax, --num_processes > 1: this process's rank; process 0 "
                     "writes --out_dir, process k writes OUT_DIR.processK.", lower_bound=0)
flags.DEFINE_string("coordinator", None, "jax, --num_processes > 1: HOST:PORT of process 0's "
                    "coordinator (the same on every process).")
flags.DEFINE_float("step_time_ms", None, "Fixed simulator step time in ms (instead of the "
                   "roofline cost model).", lower_bound=0.0)
flags.DEFINE_string("cost_fit", None, "sim: step times from a cost fit JSON written by "
                    "experiments.calibrate (instead of the roofline); use the fitted model's "
                    "--model and the same --buckets.")
flags.DEFINE_enum("workload", "poisson", list(WORKLOADS), "Arrival process, a trace file, or "
                  "prompts that share prefixes: shared_prefix (a few system prompts, Zipf "
                  "popularity, and private suffixes) or conversation (multi-turn chats whose "
                  "turns hold the conversation so far).")
flags.DEFINE_string("trace", None, "Trace file (JSONL or CSV) for --workload=trace.")
flags.DEFINE_float("trace_time_scale", 1.0, "Multiplies the trace's arrival times (and "
                   "deadlines): 0.5 replays it at twice its request rate.")
flags.DEFINE_integer("num_requests", None, "Requests in the workload (the first N of a trace; "
                     "of conversation: turns). Default: a whole trace; else 64 on jax, 1000 on "
                     "sim.", lower_bound=1)
flags.DEFINE_float("rate", None, "Arrival rate in requests/s (poisson, gamma, shared_prefix; "
                   "conversation: conversations/s). Default: 40 on jax (tiny on a CPU), 32 on "
                   "sim.", lower_bound=0.0)
flags.DEFINE_float("cv", 1.0, "Coefficient of variation of gamma inter-arrival gaps.",
                   lower_bound=0.0)
flags.DEFINE_string("prompt_len", None, "Prompt length distribution: fixed:N, uniform:LO:HI, "
                    "lognormal:MEAN:SIGMA, zipf:A:MAX, empirical:PATH[:COLUMN]. Default: "
                    "uniform:16:128 on jax, uniform:32:512 on sim.")
flags.DEFINE_string("output_len", None, "Output length distribution (as --prompt_len). Default: "
                    "uniform:16:64 on jax, uniform:1:128 on sim.")
flags.DEFINE_integer("num_prefixes", 8, "shared_prefix: the number of system prompts.",
                     lower_bound=1)
flags.DEFINE_string("prefix_len", None, "shared_prefix: each system prompt's length (as "
                    "--prompt_len). Default: fixed:256 on jax, fixed:1024 on sim.")
flags.DEFINE_float("prefix_zipf", 1.1, "shared_prefix: the popularity exponent; system prompt k "
                   "(from 0) is picked with weight (k + 1)**-prefix_zipf (0: uniform).",
                   lower_bound=0.0)
flags.DEFINE_string("suffix_len", None, "The private part of each prompt (as --prompt_len): the "
                    "suffix after the system prompt (shared_prefix), or each turn's new message "
                    "(conversation). Default: uniform:16:64 on jax, uniform:16:256 on sim.")
flags.DEFINE_string("num_turns", None, "conversation: turns per conversation (as --prompt_len). "
                    "Default: uniform:1:6 on jax, uniform:1:8 on sim.")
flags.DEFINE_string("think_time_ms", "lognormal:10000:1", "conversation: milliseconds from a "
                    "turn's arrival to the next turn's (as --prompt_len).")
flags.DEFINE_integer("max_num_seqs", None, "Batch cap: most sequences in one step. Default: 16 "
                     "on jax, 64 on sim.", lower_bound=1)
flags.DEFINE_integer("max_num_tokens", None, "Most tokens in one step (the largest bucket). "
                     "Default: 256 on jax, 2048 on sim.", lower_bound=1)
flags.DEFINE_integer("max_batch_size", None, "Deprecated: use --max_num_seqs.", lower_bound=1)
flags.DEFINE_integer("token_budget", None, "Deprecated: use --max_num_tokens.", lower_bound=1)
flags.DEFINE_integer("num_kv_pages", None, "KV pool size in pages (default: from --kv_memory_gb, "
                     "else what the GPU holds beside the weights; jax: a full batch of full "
                     "contexts).", lower_bound=1)
flags.DEFINE_float("kv_memory_gb", None, "KV pool size in GB (decimal) over the replica.")
flags.DEFINE_integer("page_size", 16, "Tokens per KV page.", lower_bound=1)
flags.DEFINE_integer("max_model_len", None, "Context limit (default: the model's).", lower_bound=2)
flags.DEFINE_list("buckets", None, "Step token sizes to pad to, ending at --max_num_tokens "
                  "(default: --bucket_ladder).")
flags.DEFINE_string("bucket_ladder", "auto", "Step token sizes by rule, unless --buckets gives "
                    "them: pow2 (powers of two), geometric:R (each about R times the last, e.g. "
                    "1.41), step:N (multiples of N), or fit:K: the K sizes (multiples of 8) that "
                    "pad least the steps of a pilot run: the simulator on the same workload, "
                    "limits, model, hardware and cluster, with the fixed reference policy vllm "
                    "(whatever --policies says, so every policy compared, and every policy at "
                    "one rate of a sweep, drives the same sizes) on a step:8 ladder; config.json "
                    "records the sizes (repeat with --buckets=...) and the pilot. Each tops out "
                    "at --max_num_tokens. auto: fit:16 on --engine=sim (pow2 with --cost_fit, "
                    "which prices only its own buckets), pow2 on --engine=jax (each size is a "
                    "compile there, and its clock is not the simulator's).")
flags.DEFINE_float("ttft_slo_s", None, "TTFT SLO for goodput, seconds.")
flags.DEFINE_float("tpot_slo_s", None, "TPOT SLO for goodput, seconds.")
flags.DEFINE_integer("seed", 0, "Workload and sampling seed.", lower_bound=0)
flags.DEFINE_integer("no_progress_steps", 10_000, "Fail the run after this many iterations in "
                     "a row in which no request gains a computed token or finishes.",
                     lower_bound=1)
flags.DEFINE_integer("num_replicas", 1, "sim: replicas behind a global router, each with its own "
                     "scheduler, KV pool and engine.", lower_bound=1)
flags.DEFINE_string("router", "round_robin", "How --num_replicas > 1 replicas share the "
                    "arrivals: round_robin, least_outstanding (fewest requests not yet done), "
                    "least_work (fewest tokens left: an oracle), or a plugin as "
                    "package.module:Class or path/to/file.py:Class.")
flags.DEFINE_string("router_opts", "", "Router knobs: key=value,... (with --num_replicas > 1; "
                    "with one replica --router and --router_opts are refused)")
flags.DEFINE_integer("prefill_replicas", 0, "Disaggregated prefill and decode: replicas of the "
                     "prefill pool (with --decode_replicas; 0: colocated).", lower_bound=0)
flags.DEFINE_integer("decode_replicas", 0, "Disaggregated: replicas of the decode pool.",
                     lower_bound=0)
flags.DEFINE_string("prefill_policy", None, "Disaggregated: the prefill pool's policy "
                    "(default: --policy).")
flags.DEFINE_string("decode_policy", None, "Disaggregated: the decode pool's policy "
                    "(default: --policy).")
flags.DEFINE_string("prefill_policy_opts", None, "Disaggregated: the prefill policy's knobs "
                    "(default: --policy_opts when it is --policy).")
flags.DEFINE_string("decode_policy_opts", None, "Disaggregated: the decode policy's knobs.")
flags.DEFINE_string("prefill_router", "least_outstanding", "Disaggregated: which prefill "
                    "replica takes each arrival (a router, as --router).")
flags.DEFINE_string("decode_router", "least_outstanding", "Disaggregated: which decode "
                    "replica takes each prefilled request (a router, as --router).")
flags.DEFINE_string("kv_link", "ib200", "Disaggregated: the KV link preset: nvlink (nvlink3), "
                    "nvlink4, ib200, ib400, pcie4, pcie5.")
flags.DEFINE_integer("kv_link_max_concurrent", 1, "Disaggregated: KV transfers in flight on one "
                     "(prefill, decode) link at once; the rest queue.", lower_bound=1)
flags.DEFINE_bool("count_host_time", False, "Add the scheduler's measured host time (planning, "
                  "packing, bookkeeping) to the virtual clock, as a real server pays it; runs "
                  "are then no longer repeatable bit for bit.")
flags.DEFINE_bool("log_step_requests", False, "Write each step's request ids and token counts "
                  "to steps.jsonl (request_ids, request_tokens).")
flags.DEFINE_string("out_dir", "runs/latest", "Output directory.")
flags.DEFINE_string("policy_opts", "", "Policy knobs: key=value,... (in compare and sweep: "
                    "label.key=value, label as named in --policies). A knob named like a "
                    "scheduler limit (max_num_seqs, max_num_tokens, num_kv_pages, "
                    "max_model_len) may not exceed the run's flag of that name: that is an "
                    "error, not a silent cap.")

TABLE_COLUMNS = ("policy", "num_finished", "num_rejected", "num_steps", "duration_s",
                 "throughput_req_s", "throughput_tok_s", "ttft_p50_s", "ttft_p99_s",
                 "tpot_p50_s", "tpot_p99_s", "latency_p50_s", "latency_p99_s",
                 "normalized_latency_mean_s", "num_preemptions", "padding_fraction",
                 "num_buckets",  # the compiled step shapes (of the ladder) beside the padding
                 "prefix_hit_rate",  # only with prefix caching active ('-' otherwise)
                 "goodput_req_s", "slo_attainment")  # only with an SLO set ('-' otherwise)

# Deprecated flag -> the flag it sets now (kept for one release).
RENAMED_FLAGS = {"max_batch_size": "max_num_seqs", "token_budget": "max_num_tokens"}

# The embedded defaults: a small workload the tiny real model serves in seconds on a
# laptop CPU, and a GPU-scale one for the simulator.
ENGINE_DEFAULTS = {
    "jax": dict(model="tiny", num_requests=64, rate=40.0, prompt_len="uniform:16:128",
                output_len="uniform:16:64", max_num_seqs=16, max_num_tokens=256,
                prefix_len="fixed:256", suffix_len="uniform:16:64", num_turns="uniform:1:6"),
    "sim": dict(model="llama3-8b", num_requests=1000, rate=32.0, prompt_len="uniform:32:512",
                output_len="uniform:1:128", max_num_seqs=64, max_num_tokens=2048,
                prefix_len="fixed:1024", suffix_len="uniform:16:256", num_turns="uniform:1:8"),
}

FLAGS = flags.FLAGS


def _validate_length(name: str, column: str) -> None:
    def check(value: Optional[str]) -> bool:
        if value is None:
            return True
        try:
            parse_length_spec(value, default_column=column)
        except (ValueError, OSError) as e:
            raise flags.ValidationError(str(e)) from e
        return True
    flags.register_validator(name, check)


_validate_length("prompt_len", "prompt_len")
_validate_length("output_len", "output_len")
for _name, _column in LENGTH_COLUMNS.items():
    _validate_length(_name, _column)


AUTO_LADDER = {"sim": "fit:16", "jax": "pow2"}  # --bucket_ladder=auto, by engine


def _buckets(max_num_tokens: int) -> tuple[Optional[tuple[int, ...]], Optional[str]]:
    """(token_buckets, bucket_ladder) of the LimitsSpec: the sizes of --buckets or of a rule
    ladder, or the `fit:K` ladder the runner fits (`runner.bucket_pilot`)."""
    if FLAGS.buckets:
        if FLAGS["bucket_ladder"].present:
            raise app.UsageError("--buckets and --bucket_ladder both choose the step sizes: "
                                 "give one")
        try:
            return tuple(int(b) for b in FLAGS.buckets), None
        except ValueError:
            raise flags.ValidationError(f"--buckets={','.join(FLAGS.buckets)}: expected "
                                        "integers") from None
    ladder = FLAGS.bucket_ladder
    if ladder == "auto":
        ladder = "pow2" if FLAGS.cost_fit else AUTO_LADDER[FLAGS.engine]
        if ladder == "pow2":
            return None, None  # the library's default: the config (and a sweep's) as before
    try:
        if parse_fit_ladder(ladder) is not None:
            return None, ladder  # LimitsSpec checks K against --max_num_tokens
    except ValueError as e:
        raise app.UsageError(f"--bucket_ladder: {e}") from None
    try:
        return ladder_token_sizes(ladder, max_num_tokens), None
    except ValueError as e:
        raise app.UsageError(f"--bucket_ladder: {e}, fit:K (K >= 1) or auto") from None


def _take_renamed_flags() -> None:
    """Sets each new flag from its deprecated name, if given, with one warning line.

    Raises:
      app.UsageError: the old and the new name are both given, with different values.
    """
    for old, new in RENAMED_FLAGS.items():
        if not FLAGS[old].present:
            continue
        value = FLAGS[old].value
        print(f"--{old} is deprecated; use --{new}", file=sys.stderr)
        if FLAGS[new].present and FLAGS[new].value != value:
            raise app.UsageError(f"--{old}={value} and --{new}={FLAGS[new].value} disagree; "
                                 f"give only --{new}")
        FLAGS[new].value = value


def _check_router_flags() -> None:
    """Refuses --router or --router_opts given with one replica (they would do nothing)."""
    given = [f"--{name}={FLAGS[name].value}" for name in ("router", "router_opts")
             if FLAGS[name].present]
    if given and FLAGS.num_replicas == 1:
        raise app.UsageError(f"{' '.join(given)} routes between replicas, but --num_replicas=1; "
                             "give --num_replicas > 1 or drop the router flags")


def spec_from_flags() -> RunSpec:
    """The RunSpec the flags describe (unset flags take the engine's defaults)."""
    _take_renamed_flags()
    _check_router_flags()
    defaults = ENGINE_DEFAULTS[FLAGS.engine]

    def pick(name: str):
        value = getattr(FLAGS, name)
        return defaults[name] if value is None else value

    # Only the prefix workloads read these: another workload keeps them at their defaults,
    # so its config (and a sweep's fingerprint of it) does not vary with the engine.
    prefix_knobs = {}
    if FLAGS.workload in ("shared_prefix", "conversation"):
        prefix_knobs = dict(num_prefixes=FLAGS.num_prefixes, prefix_len=pick("prefix_len"),
                            prefix_zipf=FLAGS.prefix_zipf, suffix_len=pick("suffix_len"),
                            num_turns=pick("num_turns"), think_time_ms=FLAGS.think_time_ms)
    token_buckets, bucket_ladder = _buckets(pick("max_num_tokens"))
    try:
        engine: JaxEngineSpec | SimEngineSpec
        if FLAGS.engine == "jax":
            # A process setting, not part of the spec: a cached program is the same program.
            from orca_jax.model import compile_cache
            compile_cache.enable(FLAGS.compile_cache)
            engine = JaxEngineSpec(model=pick("model"), checkpoint=FLAGS.checkpoint,
                                   dtype=FLAGS.dtype, attention=FLAGS.attention,
                                   sampling=FLAGS.sampling, clock=FLAGS.clock, tp=FLAGS.tp,
                                   profile_table=FLAGS.profile_table, overlap=FLAGS.overlap)
        else:
            engine = SimEngineSpec(model=pick("model"), hardware=FLAGS.hardware, tp=FLAGS.tp,
                                   step_time_ms=FLAGS.step_time_ms, cost_fit=FLAGS.cost_fit)
        return RunSpec(
            workload=WorkloadSpec(arrival=FLAGS.workload, trace=FLAGS.trace,
                                  trace_time_scale=FLAGS.trace_time_scale,
                                  num_requests=FLAGS.num_requests
                                  if FLAGS.workload == "trace" else pick("num_requests"),
                                  rate=pick("rate"),
                                  cv=FLAGS.cv, prompt_len=pick("prompt_len"),
                                  output_len=pick("output_len"), **prefix_knobs),
            engine=engine,
            limits=LimitsSpec(max_num_seqs=pick("max_num_seqs"),
                              max_num_tokens=pick("max_num_tokens"),
                              num_kv_pages=FLAGS.num_kv_pages, kv_memory_gb=FLAGS.kv_memory_gb,
                              page_size=FLAGS.page_size, max_model_len=FLAGS.max_model_len,
                              token_buckets=token_buckets, bucket_ladder=bucket_ladder,
                              log_step_requests=FLAGS.log_step_requests,
                              count_host_time=FLAGS.count_host_time,
                              no_progress_steps=FLAGS.no_progress_steps),
            cluster=ClusterSpec(num_replicas=FLAGS.num_replicas, router=FLAGS.router,
                                router_opts=FLAGS.router_opts,
                                num_prefill_replicas=FLAGS.prefill_replicas,
                                num_decode_replicas=FLAGS.decode_replicas,
                                prefill_policy=FLAGS.prefill_policy,
                                decode_policy=FLAGS.decode_policy,
                                prefill_policy_opts=FLAGS.prefill_policy_opts,
                                decode_policy_opts=FLAGS.decode_policy_opts,
                                prefill_router=FLAGS.prefill_router,
                                decode_router=FLAGS.decode_router, kv_link=FLAGS.kv_link,
                                kv_link_max_concurrent=FLAGS.kv_link_max_concurrent),
            seed=FLAGS.seed, ttft_slo_s=FLAGS.ttft_slo_s, tpot_slo_s=FLAGS.tpot_slo_s)
    except ValueError as e:
        raise _spec_usage_error(e) from e


# The spec fields whose flag has another name.
_FLAG_OF_FIELD = {"arrival": "workload", "token_buckets": "buckets"}


def _spec_usage_error(error: ValueError) -> app.UsageError:
    """The spec's complaint led by the flag it came from: `--rate: workload.rate must be ...`."""
    match = re.match(r"(?:workload|engine|limits|cluster|run)\.(\w+)", str(error))
    flag = _FLAG_OF_FIELD.get(match.group(1), match.group(1)) if match else None
    return app.UsageError(f"--{flag}: {error}" if flag and flag in FLAGS else str(error))


def join_processes() -> Optional[str]:
    """Joins --num_processes processes (jax.distributed) before any jax use.

    Returns:
      The output folder of this process: --out_dir on process 0 (and on a single
      process), OUT_DIR.processK on process K.

    Raises:
      app.UsageError: naming the flag and value that cannot make a process group.
    """
    if FLAGS.num_processes == 1:
        return FLAGS.out_dir
    if FLAGS.engine != "jax":
        raise app.UsageError(f"--num_processes={FLAGS.num_processes} runs the jax engine over "
                             f"several processes; --engine={FLAGS.engine} runs in one")
    from orca_jax.model import distributed

    try:
        group = distributed.ProcessGroup(coordinator=FLAGS.coordinator,
                                         num_processes=FLAGS.num_processes,
                                         process_id=FLAGS.process_id)
    except ValueError as error:
        raise app.UsageError(str(error)) from None
    distributed.initialize(group)
    if FLAGS.process_id == 0 or FLAGS.out_dir is None:
        return FLAGS.out_dir
    return f"{FLAGS.out_dir.rstrip('/')}.process{FLAGS.process_id}"
