"""The run-plumbing flags shared by experiments.run, .compare and .sweep.

Flags are plumbing only (engine, model, workload, limits, output); experiment
knobs live on policies (`--policy_opts`). `spec_from_flags()` resolves them into
an `orca_jax.experiment.RunSpec`.
"""

from __future__ import annotations

from typing import Optional

from absl import flags

from orca_jax.experiment import ENGINES, WORKLOADS, RunSpec
from orca_jax.workload import parse_length_spec

flags.DEFINE_enum("engine", "sim", list(ENGINES), "Engine: the cost-model simulator or the real "
                  "JAX model.")
flags.DEFINE_string("model", None, "Model preset (sim: llama3-8b, llama2-7b, mistral-7b, opt-13b, "
                    "gpt3-175b, tiny, small). Default: llama3-8b on sim, tiny on jax.")
flags.DEFINE_string("hardware", "a100", "Hardware preset of the simulator: a100 (80GB), a100-40gb, "
                    "h100, h200.")
flags.DEFINE_integer("tp", 1, "Tensor-parallel degree of the simulated replica.", lower_bound=1)
flags.DEFINE_float("step_time_ms", None, "Fixed simulator step time in ms (instead of the "
                   "roofline cost model).", lower_bound=0.0)
flags.DEFINE_enum("workload", "poisson", list(WORKLOADS), "Arrival process, or a trace file.")
flags.DEFINE_string("trace", None, "Trace file (JSONL or CSV) for --workload=trace.")
flags.DEFINE_integer("num_requests", 200, "Requests in the workload (the first N of a trace).",
                     lower_bound=1)
flags.DEFINE_float("rate", 4.0, "Arrival rate in requests/s (poisson, gamma).", lower_bound=0.0)
flags.DEFINE_float("cv", 1.0, "Coefficient of variation of gamma inter-arrival gaps.",
                   lower_bound=0.0)
flags.DEFINE_string("prompt_len", "uniform:32:512", "Prompt length distribution: fixed:N, "
                    "uniform:LO:HI, lognormal:MEAN:SIGMA, zipf:A:MAX, empirical:PATH[:COLUMN].")
flags.DEFINE_string("output_len", "uniform:1:128", "Output length distribution (as --prompt_len).")
flags.DEFINE_integer("max_batch_size", 64, "Batch cap: most sequences in one step.", lower_bound=1)
flags.DEFINE_integer("token_budget", 2048, "Most tokens in one step (the largest bucket).",
                     lower_bound=1)
flags.DEFINE_integer("num_kv_pages", None, "KV pool size in pages (default: from --kv_memory_gb, "
                     "else what the GPU holds beside the weights).", lower_bound=1)
flags.DEFINE_float("kv_memory_gb", None, "KV pool size in GB (decimal) over the replica.")
flags.DEFINE_integer("page_size", 16, "Tokens per KV page.", lower_bound=1)
flags.DEFINE_integer("max_model_len", None, "Context limit (default: the model's).", lower_bound=2)
flags.DEFINE_list("buckets", None, "Step token sizes to pad to (default: powers of two up to "
                  "--token_budget).")
flags.DEFINE_float("ttft_slo_s", None, "TTFT SLO for goodput, seconds.")
flags.DEFINE_float("tpot_slo_s", None, "TPOT SLO for goodput, seconds.")
flags.DEFINE_integer("seed", 0, "Workload and sampling seed.", lower_bound=0)
flags.DEFINE_string("out_dir", "runs/latest", "Output directory.")
flags.DEFINE_string("policy_opts", "", "Policy knobs: key=value,... (in compare and sweep: "
                    "policy.key=value, policy as named in --policies).")

TABLE_COLUMNS = ("policy", "num_finished", "num_rejected", "num_steps", "duration_s",
                 "throughput_req_s", "throughput_tok_s", "ttft_p50_s", "ttft_p99_s",
                 "tpot_p50_s", "tpot_p99_s", "latency_p50_s", "latency_p99_s",
                 "normalized_latency_mean_s", "num_preemptions", "padding_fraction")

FLAGS = flags.FLAGS


def _validate_length(name: str) -> None:
    def check(value: str) -> bool:
        try:
            parse_length_spec(value, default_column=None if value.startswith("empirical") else None)
        except (ValueError, OSError) as e:
            raise flags.ValidationError(str(e)) from e
        return True
    flags.register_validator(name, check)


_validate_length("prompt_len")
_validate_length("output_len")


def _buckets() -> Optional[tuple[int, ...]]:
    if not FLAGS.buckets:
        return None
    try:
        return tuple(int(b) for b in FLAGS.buckets)
    except ValueError:
        raise flags.ValidationError(f"--buckets={','.join(FLAGS.buckets)}: expected integers") \
            from None


def spec_from_flags() -> RunSpec:
    """The RunSpec the flags describe."""
    model = FLAGS.model or ("tiny" if FLAGS.engine == "jax" else "llama3-8b")
    return RunSpec(
        engine=FLAGS.engine, model=model, hardware=FLAGS.hardware, tp=FLAGS.tp,
        step_time_ms=FLAGS.step_time_ms, workload=FLAGS.workload, trace=FLAGS.trace,
        num_requests=FLAGS.num_requests, rate=FLAGS.rate, cv=FLAGS.cv,
        prompt_len=FLAGS.prompt_len, output_len=FLAGS.output_len,
        max_batch_size=FLAGS.max_batch_size, token_budget=FLAGS.token_budget,
        num_kv_pages=FLAGS.num_kv_pages, kv_memory_gb=FLAGS.kv_memory_gb,
        page_size=FLAGS.page_size, max_model_len=FLAGS.max_model_len, token_buckets=_buckets(),
        ttft_slo_s=FLAGS.ttft_slo_s, tpot_slo_s=FLAGS.tpot_slo_s, seed=FLAGS.seed)
