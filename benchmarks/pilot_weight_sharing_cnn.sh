#!/bin/bash
# Pilot for issue 42's defaults question, not a study trial: on the demo's model (the
# built-in `cnn`: three convolutions and max-pooling, then a flattened 576-feature head),
# with `spdkfac train`'s K-FAC defaults otherwise, does `--weight-sharing reduce` reach
# the accuracy `expand` (the default) reaches? Seeds 0 and 1 of each, alternating, 3
# epochs, one run at a time (2 workers, one thread each). Companion of
# benchmarks/pilot_weight_sharing_default.py (synthetic, pooled and flattened heads).
# Output: benchmarks/reports/pilot_weight_sharing_default/cnn.txt (name, steps, mean
# ms/step, then seconds / steps to 88 % and 90 % test accuracy, final test accuracy).
OUT=${OUT:-/tmp/pilot_weight_sharing_cnn}
COMMON=(--model cnn --dataset fashion-mnist --batch-size 128 --no-tensorboard --threads 1
  --optimizer kfac --epochs 3 --evals-per-epoch 4)
report() { accuracy_report "$OUT/$1/summary.json" "$1" test_accuracy 0.88 0.90; }
source "$(dirname "$0")/pilot_common.sh"
run expand-seed0 --weight-sharing expand --seed 0
run reduce-seed0 --weight-sharing reduce --seed 0
run expand-seed1 --weight-sharing expand --seed 1
run reduce-seed1 --weight-sharing reduce --seed 1
