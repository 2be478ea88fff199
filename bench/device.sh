#!/usr/bin/env bash
# The sessions benchmark on a GPU machine (mlx[cuda] on Linux, plain mlx on
# macOS), ready for when one is lent:
#
#   bash bench/device.sh            # from the repository root
#
# It makes a venv with mlx[cuda], installs the package, and runs
# bench.sessions on the small and medium fixtures for N = 1, 2, 4, 8,
# writing build/device/sessions_<size>.json and .png.
#
# What it is expected to print: the "together f/s" column tracks "serial f/s"
# (ratio ~1.0 at every N) while a step advances its sessions one after
# another; on a GPU the weight reads are shared only once the stages run as
# one batched compute, which is what the ratio would then show (> 1, growing
# with N up to the point where compute, not weight reads, dominates).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/device}
mkdir -p "$OUT"
python3 -m venv "$OUT/venv"
"$OUT/venv/bin/pip" install -q --upgrade pip
if [ "$(uname -s)" = "Linux" ]; then
  "$OUT/venv/bin/pip" install -q "mlx[cuda]"
fi
"$OUT/venv/bin/pip" install -q -e ".[bench]"
"$OUT/venv/bin/python" -c "import mlx.core as mx; print('device:', mx.default_device())"
for size in small medium; do
  "$OUT/venv/bin/python" -m bench.sessions --size "$size" --sessions 1 2 4 8 --seconds 2 \
    --json "$OUT/sessions_$size.json" --png "$OUT/sessions_$size.png"
done
