"""CPU seconds one `experiments.run` spends writing its results, beside the whole run.

    PYTHONPATH=. python benchmarks/results_io_cpu.py --engine=sim --policy=vllm ... \
        --out_dir=/tmp/run

Runs `experiments.run` in this process with the given flags, with timers
(`time.process_time`) around the results code of whichever tree is on the path:
the live run's streaming (`StreamResults.__call__` and `flush`), the finished
run's files (`experiment.finish_run_folder`) and its summary (`experiment.summarize_run`),
and prints one line on stderr: the run's process time, theirs together, and each.
Run it from an old revision's tree and from this one, in turns, to compare the two
on one machine (benchmarks/results/results_io_cpu_vs_1f4a4bd.txt); the simulation's
own time varies with the machine's load as much as the results' does not.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable

from absl import app

from experiments import run
from orca_jax.runner import experiment, live_results

_spent: dict[str, float] = {}
_depth = [0]  # a timed call inside another (flush inside __call__) counts once


def _timed(owner: Any, name: str, key: str) -> None:
    """Replaces `owner.name` by a wrapper adding its process time to `_spent[key]`."""
    real: Callable[..., Any] = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        if _depth[0]:
            return real(*args, **kwargs)
        _depth[0] += 1
        start = time.process_time()
        try:
            return real(*args, **kwargs)
        finally:
            _spent[key] = _spent.get(key, 0.0) + time.process_time() - start
            _depth[0] -= 1
    setattr(owner, name, timed)


def main() -> None:
    _timed(live_results.StreamResults, "__call__", "stream")
    _timed(live_results.StreamResults, "flush", "stream")
    # Trees before the rename (1f4a4bd's included) call it `_finish`.
    _timed(experiment, "finish_run_folder" if hasattr(experiment, "finish_run_folder")
           else "_finish", "finish")
    _timed(experiment, "summarize_run", "summary")
    sys.argv = ["run", *sys.argv[1:]]
    start = time.process_time()
    try:
        app.run(run.main)
    except SystemExit:
        pass
    total = time.process_time() - start
    results = sum(_spent.values())
    parts = " ".join(f"{key} {value:.3f}" for key, value in sorted(_spent.items()))
    print(f"RESULT total {total:.3f} results {results:.3f} ({results / total:.1%}) {parts}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
