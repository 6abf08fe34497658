#!/usr/bin/env bash
# MoD-Multi as the paper defines it (one debate round) in the main setting, and MAD by debate
# rounds (pre-registered in eval/logs/mod.md, "MoD-Multi as the paper defines it"). One process,
# one thread:   bash eval/toys/mod_paper_rounds.sh
# 1. per seed 0, 1, 2: MoD at 1e-2, 500 steps, scored on the 600 test questions, single round and
#    MoD-Multi rounds=1 (--debate-metrics single: the misled rows are not asked here)
#    -> OUT/debate/lr/results_paper_rounds.json (resumable; optional run-length limits MAX_MINUTES /
#    MAD_MAX_MINUTES, minutes from the start, for steps 1 and 2-3: no new work starts after them; unset: none);
# 2. within MAD_MAX_MINUTES: MAD with 1, 2, 3 debate rounds on the frozen base beside MoD-Single /
#    MoD-Multi 1 and 2 rounds (seed 0's adapters), the first MAD_TEST test questions -> OUT/mad_rounds.json;
# 3. within MAD_MAX_MINUTES: MoD-Multi rounds=2 on the seeds trained (the reproduction check of H7).
set -u
OUT=${OUT:-out/mod}; MAD_TEST=${MAD_TEST:-64}; MAX_MINUTES=${MAX_MINUTES:-}; MAD_MAX_MINUTES=${MAD_MAX_MINUTES:-}; START=$(date +%s)
M="python -m eval.toys.mod --part debate-lr --debate-test 600 --debate-steps 500 --debate-picks MoD=1e-2 \
   --debate-metrics single --debate-lr-tag _paper_rounds --threads 1 --out $OUT"
export OMP_NUM_THREADS=1
before() { [ -z "$1" ] || [ $(( $(date +%s) - START )) -lt $(( $1 * 60 )) ]; }
done_seeds=""
for s in 0 1 2; do
  if [ -f "$OUT/debate/lr/MoD_lr0.01_steps500_s$s/train.json" ] || before "$MAX_MINUTES"; then
    echo "$(date -u +%T) MoD seed $s: train (if missing), single + rounds=1"
    $M --debate-seeds $s --debate-rounds 1 || exit 1
    done_seeds="$done_seeds,$s"
  else
    echo "$(date -u +%T) MAX_MINUTES reached: MoD seed $s not run"
  fi
done
if before "$MAD_MAX_MINUTES"; then
  echo "$(date -u +%T) MAD rounds 1,2,3 on $MAD_TEST questions"
  python -m eval.toys.mod --part mad-rounds --mad-rounds 1,2,3 --debate-test "$MAD_TEST" --threads 1 --out "$OUT" || exit 1
fi
if before "$MAD_MAX_MINUTES"; then
  echo "$(date -u +%T) rounds=2 on seeds ${done_seeds#,}"
  $M --debate-seeds "${done_seeds#,}" --debate-rounds 1,2 --debate-no-train || exit 1
fi
# the report over everything on disk (trains and scores nothing)
$M --debate-seeds 0,1,2 --debate-rounds 1,2 --debate-no-train
echo "$(date -u +%T) done"
