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
