#!/usr/bin/env bash
# Everything this repository checks on a lent GPU, as one call (docs/attention_kernel.md,
# "The GPU check"): run from the repository root on the GPU machine, with its own jax and
# nothing installed. Raw outputs go to $OUT (default /tmp/gpu_check); each part has its
# own time limit, so one that hangs or runs long leaves the others their time. The limits
# add up to the device tool's 600 s a call; on an H200 the parts took about 90, 115, 30,
# 45 and 80 s (2026-11-30).
#
#   OUT=/tmp/gpu_check bash benchmarks/gpu_check.sh [attention_gpu.py args...]
set -u
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
status=0
part() {  # part NAME SECONDS COMMAND...: run, tee the log, note the exit status
  local name=$1 seconds=$2
  shift 2
  echo "=== $name (limit ${seconds}s) $(date -u +%H:%M:%S)"
  local start=$SECONDS
  timeout "$seconds" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - start)) s"
  [ "$rc" = 0 ] || status=1
}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,temperature.gpu \
  --format=csv 2>&1 | tee "$OUT/nvidia_smi.txt"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
# 1. The kernel: correctness vs float64, ceilings, timings of every config vs reference/dense.
part attention_h200 "${ATTENTION_S:-200}" python3 -m benchmarks.attention_gpu \
  --out "$OUT/attention_h200.txt" "$@"
# 2. The engine on the GPU: whole steps, reference vs the Pallas kernel, greedy tokens compared.
part engine_step_h200 "${ENGINE_S:-150}" python3 benchmarks/engine_step.py --models tiny small \
  --kv_lens 128 1024 --repeats 20
# 3. Steps loaded from the executable cache: the same tokens as compiled ones, step by step.
part executable_cache_check_h200 "${CACHE_CHECK_S:-60}" python3 -m benchmarks.executable_cache_check
# 4. The README's main job twice on the GPU (Pallas attention): the second from the caches.
part readme_main_job_h200 "${MAIN_JOB_S:-90}" python3 -m benchmarks.readme_main_job --repeats 1
# 5. Overlap scheduling against in-step (slower than in step on the H200 so far).
part overlap_h200 "${OVERLAP_S:-100}" python3 -m benchmarks.overlap --models tiny small --repeats 3
exit $status
