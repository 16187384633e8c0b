#!/bin/bash
# Pilot of issue 41's transformer forms (2026-12-03), before the study's text revision 3;
# not study trials: one seed each, untuned starting points, the forms against the
# baselines at the same settings. The revision-3 model shape (the built-in GPT, 4 blocks,
# width 128, context 128), batch 16 per worker, 2 workers with one thread each, 400 steps
# with a cosine schedule over them, validation bits per byte every 100 steps. Corpus:
# fortunes (repeats within 400 steps; the study's revision 3 moves to dict-gcide).
# Timings: the machine was shared with other work during this pilot (step times are
# indicative only; the study times its final runs alone).
# Output: benchmarks/reports/pilot_text_forms/out.txt: name, (step, bits per byte), mean
# and median ms per step (train seconds over steps includes refresh steps).
OUT=${OUT:-/tmp/pilot_text_forms}
COMMON=(--model gpt --dataset text --batch-size 16 --gpt-layers 4 --gpt-dim 128 --gpt-heads 4
  --no-tensorboard --threads 1 --lr-schedule cosine --max-steps 400 --lr-schedule-steps 400
  --eval-every 100 --overwrite)
report() {
  python3 -c "
import json; s = json.load(open('$OUT/$1/summary.json')); m = s['metrics']
print('$1', [(x['step'], round(x['val_bits_per_byte'], 3)) for x in m],
      'mean %.1f ms' % (1000 * s['train_seconds'] / s['steps']),
      'median %.1f ms' % s['median_iteration_ms'])"
}
source "$(dirname "$0")/pilot_common.sh"
run adamw --optimizer adamw --lr 0.003 --weight-decay 0.01
run muon --optimizer muon --lr 0.007 --weight-decay 0.05 --momentum 0.95
run kfac-muon-d0.1 --optimizer kfac-muon --lr 0.007 --weight-decay 0.05 --momentum 0.95 \
  --damping 0.1 --factor-update-steps 5 --inv-update-steps 10
run kfac-eigen-adam --optimizer kfac-eigen-adam --lr 0.005 --weight-decay 0.05 \
  --factor-update-steps 2 --inv-update-steps 10
run soap --optimizer soap --lr 0.006 --weight-decay 0.05
run kfac-muon-d0.01 --optimizer kfac-muon --lr 0.007 --weight-decay 0.05 --momentum 0.95 \
  --damping 0.01 --factor-update-steps 5 --inv-update-steps 10
