#!/bin/bash
# Pilot before the study's image revision 4 (issue 42), not study trials: which of K-FAC's
# forms and options earn a place in its third tuning stage? Each run is the revision-3
# K-FAC configuration (its final runs' flags) with one change, scored as a tuning trial is
# (seed 0, 10 % of the training set held out, 4 validation evaluations per epoch; the test
# set is not looked at). One run at a time, 2 workers with one thread each.
#   control            cholesky inverses, expand (revision 3's K-FAC)
#   reduce             --weight-sharing reduce (Eschenhagen et al. 2023)
#   eigen-basis-*      the exact damped Kronecker inverse (EK-FAC's eigenbasis), damping
#                      0.09 (revision 3's) and 0.3 (it damps the product, not each factor)
#   one-sided          A-only K-FAC, damping 0.3 relative to A's mean eigenvalue
#   eigen-adam         Adam in K-FAC's eigenbases: a whole update, so SGD without momentum
#                      and no KL clip, at AdamW's revision-3 learning rate and decay
#   examples-16        factor statistics from 16 of each worker's 128 examples (not 32)
#   bn-unit-wise       Osawa et al.'s BatchNorm curvature, damped 16x (their code)
#   damping-warmup     Osawa et al.'s damping warm-up: 0.9 decaying to 0.09 over 235 steps
# Output: benchmarks/reports/pilot_image_forms/out.txt: name, steps, mean ms/step, then
# seconds / steps to 92.5 % and 93.5 % validation accuracy (the tuning targets), and the
# final validation accuracy.
OUT=${OUT:-/tmp/pilot_image_forms}
COMMON=(--model resnet20 --dataset fashion-mnist --batch-size 128 --no-tensorboard --threads 1
  --lr-schedule cosine --optimizer kfac --strategy spd-kfac --factor-examples 32 --epochs 6
  --factor-update-steps 5 --inv-update-steps 100
  --val-split 0.1 --evals-per-epoch 4 --seed 0)
KFAC=(--momentum 0.9 --nesterov --lr 0.0807 --weight-decay 0.000317)
report() { accuracy_report "$OUT/$1/summary.json" "$1" val_accuracy 0.925 0.935; }
source "$(dirname "$0")/pilot_common.sh"
run control "${KFAC[@]}" --damping 0.09
run reduce "${KFAC[@]}" --damping 0.09 --weight-sharing reduce
run eigen-basis-0.09 "${KFAC[@]}" --damping 0.09 --inverse-method eigen-basis
run one-sided "${KFAC[@]}" --damping 0.3 --inverse-method one-sided
run eigen-adam --momentum 0 --lr 0.00538 --weight-decay 0.023 --kl-clip 0 \
  --inverse-method eigen-adam
run examples-16 "${KFAC[@]}" --damping 0.09 --factor-examples 16
run bn-unit-wise "${KFAC[@]}" --damping 0.09 --batchnorm unit-wise \
  --batchnorm-damping-multiplier 16
run damping-warmup "${KFAC[@]}" --damping 0.09 --damping-initial 0.9 \
  --damping-warmup-steps 235
run eigen-basis-0.3 "${KFAC[@]}" --damping 0.3 --inverse-method eigen-basis
