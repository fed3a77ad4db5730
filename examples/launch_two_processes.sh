#!/usr/bin/env bash
# One run of the jax engine over two processes on this machine (jax.distributed, gloo on
# the CPU): the tp=2 mesh spans one CPU device of each process. Every process gets the same
# flags but --process_id; process 0 writes --out_dir, process 1 writes OUT_DIR.process1.
# On a multi-host GPU cluster run the same command once per host (docs/multi_host.md).
set -euo pipefail
cd "$(dirname "$0")/.."
port=$(python -c "import socket; s = socket.socket(); s.bind(('localhost', 0)); print(s.getsockname()[1])")
common=(--engine=jax --model=tiny --policy=orca --num_requests=16 --tp=2
        --num_processes=2 --coordinator="localhost:${port}" --out_dir="${1:-runs/two_processes}")
JAX_PLATFORMS=cpu python -m experiments.run "${common[@]}" --process_id=1 > /dev/null &
follower=$!
JAX_PLATFORMS=cpu python -m experiments.run "${common[@]}" --process_id=0
wait "$follower"
