#!/usr/bin/env bash
# The GPU bench on a lent NVIDIA machine (issue 32), one prepared command:
#
#   bash bench/device.sh        # from the repository root, on the GPU machine
#
# That machine has Python 3.12 with numpy, safetensors, tokenizers,
# sentencepiece, transformers and matplotlib, but no MLX and no registry
# access: MLX and the MLX hosts travel as cp312 wheels (ignored by git; fetch
# them HERE first with `bash bench/gpu_wheels.sh`). mlx-cuda-13 (about 90 MB)
# is over the 64 MiB one call carries, so the wheels travel in two calls back
# to back (the machine stays warm 30 s between them): the first carries .whl/
# (every other wheel and the first half of mlx-cuda-13) and only copies it to
# /tmp/gpu-wheels; the second carries .whl2/ (the other half), joins the
# halves, installs the wheels into /tmp/site with pip and then unpacks the
# CUDA part over them (pip's --upgrade replaces mlx/, so it comes last),
# checks that MLX sees the GPU, and runs
#
#   python -m bench.gpu --size full --out $OUT/bench-gpu.json --plot $OUT/bench-gpu.png
#
# (plugin and reference side by side at the released 11B's shapes: one
# session per stage, the pool's batch curve N = 1..64, the tiny fixture's
# generate and stream times), then the CPU-comparable kernel counts of the
# medium fixture under the GPU backend. Progress lines go through
# `grep --line-buffered` so the device tool's output tail shows them live;
# the whole log is $OUT/bench-gpu.log. Every section of the JSON is written
# as soon as it is measured, so a run cut short by the time limit keeps what
# it measured. Budget: building `full` takes seconds on an H200, the
# single-session section about 2 x 130 frames, each N of the curve
# 72 + 21 steps; about 6-8 minutes in all (use timeout_s=600).
#
# Device tool calls (each command at most 2000 characters), at once one after the other:
#   run(command="bash bench/device.sh stage", carry=[".whl"], timeout_s=120)
#   run(command="bash bench/device.sh", carry=[".whl2"], timeout_s=600)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/device}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
WHEELS=/tmp/gpu-wheels  # the first call's wheels, kept on the warm machine
if [ "${1:-}" = stage ]; then
  mkdir -p "$WHEELS" && cp .whl/* "$WHEELS"/ && ls "$WHEELS" | wc -l | sed 's/$/ files staged/'
  exit 0
fi
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHEELS"/*.whl || exit 1
  if [ -f "$WHEELS/mlx_cuda_13.name" ]; then
    cuda=/tmp/$(cat "$WHEELS/mlx_cuda_13.name")
    cat "$WHEELS"/mlx_cuda_13.part-0 .whl2/mlx_cuda_13.part-1 > "$cuda" || exit 1
    "$PY" -m zipfile -e "$cuda" /tmp/site || exit 1
  fi
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  echo "no staged wheels: using the MLX already installed (pip install -e '.[cuda]')"
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
"$PY" -c "import mlx.core as mx; print('mlx', mx.__version__, 'device:', mx.default_device())" \
  || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
# The graph commit size (docs/gpu.md, "Graph commit size"): A/B it by running this
# script again with MLX_MAX_OPS_PER_BUFFER=N in its environment.
echo "MLX_MAX_OPS_PER_BUFFER=${MLX_MAX_OPS_PER_BUFFER:-unset (MLX's default)}"
# Progress: the bench's own lines, the kernel table and errors; everything to the log.
progress='^\[bench|^ *[0-9]+ +[0-9]|fixture|Error|error|Traceback'
timeout 450 "$PY" -m bench.gpu --size full --batches "${BATCHES:-1,2,4,8,16,32,64}" \
  --out "$OUT/bench-gpu.json" --plot "$OUT/bench-gpu.png" 2>&1 \
  | tee "$OUT/bench-gpu.log" | grep --line-buffered -E "$progress"
status=${PIPESTATUS[0]}
if [ "${KERNELS:-1}" = 1 ]; then
  timeout 110 "$PY" -m bench.kernels --size medium --batch 1,16 --warm-frames 72 --frames 3 \
    --json "$OUT/kernels-medium-gpu.json" 2>&1 | tee "$OUT/kernels.log" \
    | grep --line-buffered -E "$progress"
fi
exit "$status"
