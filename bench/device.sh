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
# What it is expected to print: per N, "together f/s" and "serial f/s" and
# "x one" (together over one session), "exact True" at every N. On this
# repository's 2-core CPU "x one" measured 1.35 / 1.96 / 2.32 at N = 2 / 4 / 8
# on the small fixture (tiny: 1.61 / 1.93 / 2.05; docs/serving.md, "Serving many
# sessions", whose table is the source of these figures); on a GPU, where a batched
# step reads the weights once for all sessions, it should grow with N until
# compute dominates. "exact False" would mean a CUDA kernel rounds a row
# differently inside a larger batch: run tests/test_sessions.py there too.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/device}
mkdir -p "$OUT"
python3 -m venv "$OUT/venv"
"$OUT/venv/bin/pip" install -q --upgrade pip
if [ "$(uname -s)" = "Linux" ]; then
  # The project pins mlx[cpu] on Linux; the CUDA build replaces it here.
  "$OUT/venv/bin/pip" install -q -e ".[bench]"
  "$OUT/venv/bin/pip" uninstall -q -y mlx-cpu || true
  "$OUT/venv/bin/pip" install -q "mlx[cuda]"
else
  "$OUT/venv/bin/pip" install -q -e ".[bench]"
fi
"$OUT/venv/bin/python" -c "import mlx.core as mx; print('device:', mx.default_device())"
for size in small medium; do
  "$OUT/venv/bin/python" -m bench.sessions --size "$size" --sessions 1 2 4 8 --seconds 2 \
    --json "$OUT/sessions_$size.json" --png "$OUT/sessions_$size.png"
done
