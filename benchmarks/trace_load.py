"""How fast traces load: `load_trace` on each shared trace, median wall time over rounds.

    python -m benchmarks.trace_load > benchmarks/results/trace_load.txt

The shared traces live beside the repository (`../shared/traces`, as tests/test_traces.py
finds them); a trace that is absent is skipped. The wall time is of `load_trace` alone
(reading, parsing and checking every record), in this process, after one warm-up load
that fills the OS's file cache. This was a timed assertion of tests/test_traces.py (the
Azure conversation trace under 2 s), which a loaded machine failed; a time is measured
here, never asserted.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

from orca_jax.workloads.traces import load_trace

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"
# Each trace and the vocabulary its block ids become token ids in (None: it has lengths).
NAMES = {"azure_conv_2023.csv": None, "azure_code_2023.csv": None,
         "mooncake_conversation_2025.jsonl": 128_256}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed loads per trace")
    parser.add_argument("--traces", type=Path, default=TRACES, help="the shared traces folder")
    args = parser.parse_args()
    print(f"# CPython {platform.python_version()}, {platform.machine()}; load_trace, median "
          f"of {args.rounds} loads after one warm-up")
    print(f"{'trace':>36} {'requests':>9} {'median_s':>9} {'min_s':>8} {'us/request':>11}")
    for name, vocab_size in NAMES.items():
        path = args.traces / name
        if not path.is_file():
            print(f"{name:>36} absent")
            continue
        num_requests = len(load_trace(path, vocab_size=vocab_size))  # warm-up
        times = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            load_trace(path, vocab_size=vocab_size)
            times.append(time.perf_counter() - start)
        median = statistics.median(times)
        print(f"{name:>36} {num_requests:>9} {median:>9.3f} {min(times):>8.3f} "
              f"{median / num_requests * 1e6:>11.1f}")


if __name__ == "__main__":
    main()
