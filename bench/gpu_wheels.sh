#!/usr/bin/env bash
# Fetch, HERE (a machine with registry access), the cp312 Linux wheels that
# bench/device.sh installs on the GPU machine (which has Python 3.12, numpy,
# transformers, tokenizers, sentencepiece, safetensors, matplotlib and the
# CUDA 13 runtime libraries, but no MLX and no registry). They land in .whl/
# (ignored by git), except mlx-cuda-13 (about 90 MB, over the 64 MiB a device
# call carries), split in halves: the first in .whl/, the second in .whl2/;
# bench/device.sh says how the two calls carry them.
#
#   bash bench/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
platforms=(--platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64
           --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64
           --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl \
  mlx==0.32.4 mlx-cuda-13==0.32.4 mlx-lm==0.32.2 mlx-vlm==0.7.10 mlx-audio==0.6.2 \
  miniaudio datasets dill multiprocess llguidance fastapi starlette python-multipart \
  uvicorn websockets soundfile cffi pycparser soxr
python3 -m pip download --no-deps -d .whl --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform any sounddevice || true
cuda=$(ls .whl/mlx_cuda_13-*.whl)
rm -rf .whl2 && mkdir -p .whl2 && rm -f .whl/mlx_cuda_13.part-*
split -b $(( ($(stat -c %s "$cuda") + 1) / 2 )) -d -a 1 "$cuda" .whl/mlx_cuda_13.part-
mv .whl/mlx_cuda_13.part-1 .whl2/
basename "$cuda" > .whl/mlx_cuda_13.name
rm "$cuda"
du -sh .whl .whl2
