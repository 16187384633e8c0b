#!/bin/bash
# Pilot before the study's image revision 2 (2026-12-01), kept as it ran: step cost of SGD and
# K-FAC 5/10 with and without --factor-examples 32, 60 steps each, 2 workers, one thread each.
# --image-size does not apply to Fashion-MNIST (28x28 as stored): the "28" and "32" runs are
# repeats. sgd28 ran beside a 30-s test file (disturbed); kfac28_5_10 beside a report
# regeneration at nice 19 (its repeat kfac32_5_10 is the figure quoted).
# Output: benchmarks/reports/pilot_factor_examples/out.txt (name, steps, mean ms, median ms).
OUT=${OUT:-/tmp/pilot_factor_examples}
COMMON=(--model resnet20 --dataset fashion-mnist --batch-size 128 --no-tensorboard --threads 1
  --lr-schedule cosine --epochs 1 --max-steps 60 --evals-per-epoch 1 --val-split 0.1)
report() {
  python3 -c "import json;d=json.load(open('$OUT/$1/summary.json'));print('$1', d['steps'], round(1e3*d['train_seconds']/d['steps'],1), round(d['median_iteration_ms'],1))"
}
source "$(dirname "$0")/pilot_common.sh"
run sgd32 --optimizer sgd --momentum 0.9 --nesterov --lr 0.1 --image-size 32
run sgd28 --optimizer sgd --momentum 0.9 --nesterov --lr 0.1 --image-size 28
run kfac28_5_10 --optimizer kfac --strategy spd-kfac --momentum 0.9 --nesterov --lr 0.1 --image-size 28 --factor-update-steps 5 --inv-update-steps 10
run kfac28_5_10_ex32 --optimizer kfac --strategy spd-kfac --momentum 0.9 --nesterov --lr 0.1 --image-size 28 --factor-update-steps 5 --inv-update-steps 10 --factor-examples 32
run kfac28_1_10_ex32 --optimizer kfac --strategy spd-kfac --momentum 0.9 --nesterov --lr 0.1 --image-size 28 --factor-update-steps 1 --inv-update-steps 10 --factor-examples 32
run kfac32_5_10 --optimizer kfac --strategy spd-kfac --momentum 0.9 --nesterov --lr 0.1 --image-size 32 --factor-update-steps 5 --inv-update-steps 10
