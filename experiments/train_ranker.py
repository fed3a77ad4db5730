"""Trains the `ltr` policy's ranker: `python -m experiments.train_ranker --out_dir=DIR`.

Splits a trace (--trace, JSONL or CSV) or the synthetic ranking workload (task
tokens decide the output length; `orca_jax.learned.ranker.synthetic_ranking_workload`)
in arrival order: the first --train_fraction trains the ranker, the rest is
held out. Saves the ranker with orbax to --out_dir and prints Kendall's tau
between its order and the true output-length order on the held-out requests,
next to a random ranking's. Use it with `--policy=ltr --policy_opts ranker_dir=DIR`.
"""

from __future__ import annotations

import numpy as np
from absl import app, flags, logging

from experiments.cli_errors import clean_errors, run_command
from orca_jax.learned.ranker_config import LOSSES, RankerConfig
from orca_jax.workloads.traces import TraceError, load_trace

flags.DEFINE_string("out_dir", None, "Directory to save the trained ranker in (orbax).",
                    required=True)
flags.DEFINE_string("trace", None, "Trace file (JSONL or CSV); default: the synthetic ranking "
                    "workload.")
flags.DEFINE_integer("num_requests", 2000, "Requests to use (the first N of a trace, or the "
                     "synthetic workload's size).", lower_bound=2)
flags.DEFINE_float("train_fraction", 0.8, "Fraction of the requests (first in arrival order) "
                   "used for training; the rest is held out.", lower_bound=0.0, upper_bound=1.0)
flags.DEFINE_integer("num_tasks", 8, "Synthetic workload: number of tasks.", lower_bound=1)
flags.DEFINE_float("noise_sigma", 0.25, "Synthetic workload: lognormal noise of output lengths.",
                   lower_bound=0.0)
flags.DEFINE_enum("loss", "listmle", list(LOSSES), "Ranking loss: listwise (the "
                  "paper's) or pairwise logistic.")
flags.DEFINE_integer("num_steps", RankerConfig.num_steps, "Optimizer steps.",
                     lower_bound=1)
flags.DEFINE_integer("seed", 0, "Seed of the synthetic workload, initialisation and sampling.")
FLAGS = flags.FLAGS


@clean_errors()
def main(argv: list[str]) -> None:
    del argv
    if not FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # orbax logs each file it writes at INFO
    try:
        _main()
    except TraceError as e:
        raise app.UsageError(str(e)) from None
    except FileExistsError as e:
        raise app.UsageError(f"--out_dir={FLAGS.out_dir}: {e}") from None


def _main() -> None:
    # jax, optax and orbax: only to train (--help and a refused flag never load them).
    from orca_jax.learned import ranker as ranker_lib

    if FLAGS.trace:
        requests = load_trace(FLAGS.trace, max_requests=FLAGS.num_requests)
    else:
        requests = ranker_lib.synthetic_ranking_workload(
            FLAGS.num_requests, seed=FLAGS.seed, num_tasks=FLAGS.num_tasks,
            noise_sigma=FLAGS.noise_sigma)
    num_train = int(round(FLAGS.train_fraction * len(requests)))
    train, held_out = requests[:num_train], requests[num_train:]
    if len(train) < 2 or len(held_out) < 2:
        raise app.UsageError(f"--train_fraction={FLAGS.train_fraction} of {len(requests)} "
                             f"requests leaves {len(train)} to train and {len(held_out)} held "
                             "out; both need >= 2")
    config = RankerConfig(loss=FLAGS.loss, num_steps=FLAGS.num_steps, seed=FLAGS.seed)
    ranker = ranker_lib.train_ranker(train, config)
    ranker.save(FLAGS.out_dir)
    truth = np.array([r.output_len for r in held_out])
    tau = ranker_lib.kendall_tau(ranker.scores(held_out), truth)
    tau_lengths = ranker_lib.kendall_tau(ranker.predict_output_len(held_out), truth)
    random_order = np.random.default_rng(FLAGS.seed).permutation(len(held_out))
    print(f"trained on {len(train)} requests ({FLAGS.loss}, {FLAGS.num_steps} steps); "
          f"held out {len(held_out)}")
    print(f"Kendall's tau on held-out requests: {tau:.3f} (score), {tau_lengths:.3f} "
          f"(calibrated lengths), {ranker_lib.kendall_tau(random_order, truth):.3f} (random)")
    print(f"ranker saved in {FLAGS.out_dir}; use --policy=ltr --policy_opts "
          f"ranker_dir={FLAGS.out_dir}")


if __name__ == "__main__":
    run_command(main)
