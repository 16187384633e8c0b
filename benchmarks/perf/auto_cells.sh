#!/bin/bash
# Issue 19's table: `strategy="auto"` beside every composition in every cell — ResNet-32,
# WRN-16-4 and the GPT model; loopback and the emulated 1 Gbit/s link; factors and
# inverses every step (1/1) and every 10/100 steps; 2 ranks, one thread each. Every cell
# runs the current code (auto in rounds), so the table compares like with like.
#
#   sudo bash benchmarks/perf/auto_cells.sh            # all cells not yet run (resumable)
#   bash benchmarks/perf/auto_cells.sh --list          # the cells and their commands
#
# A cell whose results.json exists is skipped, so an interrupted study continues where it
# stopped (an unfinished cell starts again). The emulated link needs root (network
# namespaces and tc). Then the table: python benchmarks/perf/auto_table.py
# benchmarks/reports/auto_cells/*/results.json
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=benchmarks/reports/auto_cells
PY=${PY:-.venv/bin/python}
mkdir -p "$ROOT"

# model  iterations-at-1/1  (10/100 runs 110 iterations, 5 of warm-up: one inverse refresh
# and ten factor refreshes in every variant's measured window)
CELLS=(
  "resnet32 20"
  "wrn16-4 16"
  "gpt 20"
)

command_for() {  # model iters link refresh
  local model=$1 iters=$2 link=$3 refresh=$4 out=$5
  local args=(-m spdkfac bench --model "$model" --variants auto)
  if [ "$refresh" = 1-1 ]; then
    args+=(--iters "$iters" --warmup 3)
  else
    args+=(--iters 110 --warmup 5 --factor-update-steps 10 --inv-update-steps 100)
  fi
  [ "$link" = 1gbit ] && args+=(--link 1gbit)
  args+=(--out-dir "$out")
  echo "${args[@]}"
}

for cell in "${CELLS[@]}"; do
  read -r model iters <<<"$cell"
  for link in loopback 1gbit; do
    for refresh in 1-1 10-100; do
      out="$ROOT/${model}_${link}_${refresh}"
      cmd=$(command_for "$model" "$iters" "$link" "$refresh" "$out")
      if [ "${1:-}" = --list ]; then
        echo "python $cmd"
        continue
      fi
      if [ -f "$out/results.json" ]; then
        echo "skip $out (done)"
        continue
      fi
      rm -rf "$out"
      echo "$(date -u +%H:%M:%S) start $out"
      # shellcheck disable=SC2086
      OMP_NUM_THREADS=1 $PY $cmd > "$out.log" 2>&1 || { echo "failed: see $out.log"; exit 1; }
      mv "$out.log" "$out/run.log"
      echo "$(date -u +%H:%M:%S) done $out"
    done
  done
done
