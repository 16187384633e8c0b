#!/bin/bash
# Pilot after the study's image revision 3 (2026-12-02), not a study trial: does K-FAC's
# cheaper `--weight-sharing reduce` for convolutions (factor statistics averaged over
# positions first; Eschenhagen et al. 2023) reach the targets as soon as the default
# (expand)? The revision-3 K-FAC configuration as its final runs ran it, seeds 1 and 2 with
# reduce and seed 1 with expand again between them (same hour, same machine).
# Output: benchmarks/reports/pilot_reduce_cnn/out.txt (name, steps, mean ms/step, then
# seconds and steps to 92 % and 93 % test accuracy, final test accuracy).
OUT=${OUT:-/tmp/pilot_reduce_cnn}
COMMON=(--model resnet20 --dataset fashion-mnist --batch-size 128 --no-tensorboard --threads 1
  --lr-schedule cosine --optimizer kfac --strategy spd-kfac --momentum 0.9 --nesterov
  --factor-examples 32 --epochs 6 --lr 0.0807 --weight-decay 0.000317 --damping 0.09
  --factor-update-steps 5 --inv-update-steps 100 --evals-per-epoch 4)
report() { accuracy_report "$OUT/$1/summary.json" "$1" test_accuracy 0.92 0.93; }
source "$(dirname "$0")/pilot_common.sh"
run reduce-seed1 --weight-sharing reduce --seed 1
run expand-seed1 --weight-sharing expand --seed 1
run reduce-seed2 --weight-sharing reduce --seed 2
