#!/usr/bin/env bash
# Everything this repository checks on a lent GPU, as one call of at most 8 minutes
# (docs/gpu.md): run from the repository root on the GPU machine, with its own jax and
# nothing installed. benchmarks/gpu_check.py runs the parts, each with its own time
# budget (printed; a part is skipped when too little time is left) and writes
# summary.txt, gpu_check.txt and gpu_check_logs.tar.gz to $OUT (default: a temp dir).
#
#   bash benchmarks/gpu_check.sh                # on the GPU
#   bash benchmarks/gpu_check.sh --dry_run      # anywhere: every part with tiny shapes
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
exec python3 -m benchmarks.gpu_check "$@"
