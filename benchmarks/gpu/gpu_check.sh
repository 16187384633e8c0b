#!/usr/bin/env bash
# The GPU check in one command: the device tests, then gpu_check.py's timings, all under $OUT.
#
#   bash benchmarks/gpu/gpu_check.sh            # on a lent GPU (about 5 minutes; hard limit 9)
#   bash benchmarks/gpu/gpu_check.sh --dry-run  # the same steps on the CPU with tiny sizes
#
# Environment: OUT (default: a new temporary directory), PYTHON (an interpreter that has
# torch; the dry run's test passes the current one), VENV (where to create a venv when no
# interpreter with torch is found; default $OUT/venv).
#
# Which Python: $PYTHON when set; else python3 when its torch sees a GPU (a lent device's
# image has a CUDA torch and no package registry: nothing can be installed there, so the
# working tree is used through PYTHONPATH); else a venv with the project's pinned torch
# (`pip install torch==2.13.0`, the pin repeated in every pip command, which needs a
# registry). The torch that ran is in $OUT/environment.json.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
TORCH_PIN="torch==2.13.0"
DRY_RUN=0
for argument in "$@"; do
    case "$argument" in
        --dry-run) DRY_RUN=1 ;;
        -h | --help) sed -n '2,15p' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument $argument (try --help)" >&2; exit 2 ;;
    esac
done

OUT="${OUT:-$(mktemp -d -t spdkfac-gpu-check.XXXXXX)}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
START=$SECONDS

if [ -n "${PYTHON:-}" ]; then
    PY="$PYTHON"
elif python3 -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    PY=python3
else
    VENV="${VENV:-$OUT/venv}"
    [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV" || exit 1
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$TORCH_PIN" || exit 1
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e "$ROOT" \
        pytest pytest-timeout pytest-xdist "$TORCH_PIN" || exit 1
    PY="$VENV/bin/python"
fi
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT" || exit 1

if [ "$DRY_RUN" = 1 ]; then
    TESTS=(tests/device/test_device_linalg.py)  # the suite runs the rest on the CPU anyway
    TEST_LIMIT=120; BENCH_LIMIT=150; BENCH_FLAGS=(--dry-run)
else
    TESTS=(tests/device)
    TEST_LIMIT=180; BENCH_LIMIT=360; BENCH_FLAGS=()
fi

echo "[gpu_check] python: $PY; out: $OUT"
command -v nvidia-smi > /dev/null && nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1

timeout "$TEST_LIMIT" "$PY" -m pytest "${TESTS[@]}" -q -n 0 -rs -p no:cacheprovider \
    --junitxml="$OUT/device_tests.xml" > "$OUT/device_tests.log" 2>&1
TESTS_RC=$?
tail -n 3 "$OUT/device_tests.log"
echo "[gpu_check] device tests: exit $TESTS_RC ($((SECONDS - START)) s)"

timeout "$BENCH_LIMIT" "$PY" benchmarks/gpu/gpu_check.py --out "$OUT" "${BENCH_FLAGS[@]}" \
    2>&1 | tee "$OUT/gpu_check.log"
BENCH_RC=${PIPESTATUS[0]}
echo "[gpu_check] timings: exit $BENCH_RC; total $((SECONDS - START)) s; wrote $OUT"
[ "$TESTS_RC" = 0 ] && [ "$BENCH_RC" = 0 ]
