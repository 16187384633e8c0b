# Sourced by the pilot scripts. `run NAME FLAGS...` trains one `spdkfac train` run under
# torchrun (2 workers, one thread each) with the caller's COMMON flags and FLAGS into
# $OUT/NAME (log: $OUT/NAME.log), then calls the caller's `report NAME`.
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
mkdir -p "$OUT"
run() {
  name=$1; shift
  rm -rf "${OUT:?}/$name"
  OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node 2 -m spdkfac train \
    "${COMMON[@]}" --out-dir "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
  report "$name"
}
# `accuracy_report SUMMARY NAME METRIC T1 T2`: NAME, steps, mean ms per step, seconds /
# steps to each target on METRIC (or "never"), then the final METRIC.
accuracy_report() {
  python3 - "$@" <<'PY'
import json, sys
path, name, metric, *targets = sys.argv[1:]
d = json.load(open(path))
hits = []
for target in map(float, targets):
    hit = [m for m in d["metrics"] if m.get(metric, 0) >= target]
    hits.append(f"{hit[0]['train_seconds']:.1f} s / {hit[0]['step']}" if hit else "never")
mean = 1e3 * d["train_seconds"] / d["steps"]
print(name, d["steps"], f"{mean:.1f}", *hits, d["metrics"][-1][metric])
PY
}
