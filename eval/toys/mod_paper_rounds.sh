#!/usr/bin/env bash
# MoD-Multi as the paper defines it (one debate round) in the main setting, and MAD by debate
# rounds (pre-registered in eval/logs/mod.md, "MoD-Multi as the paper defines it"). One process,
# one thread:   bash eval/toys/mod_paper_rounds.sh
# 1. MoD at 1e-2, 500 steps, seeds 0-2, the 600 test questions: MoD-Single, misled rows and
#    MoD-Multi rounds=1 and rounds=2 -> OUT/debate/lr/results_paper_rounds.json (resumable);
# 2. MAD with 1, 2, 3 debate rounds on the frozen base beside MoD-Single / MoD-Multi (seed 0's
#    adapters), the first MAD_TEST test questions -> OUT/mad_rounds.json.
set -u
OUT=${OUT:-out/mod}; MAD_TEST=${MAD_TEST:-200}
export OMP_NUM_THREADS=1
echo "$(date -u +%T) start MoD seeds 0-2, rounds 1,2"
python -m eval.toys.mod --part debate-lr --debate-test 600 --debate-steps 500 --debate-picks MoD=1e-2 \
  --debate-seeds 0,1,2 --debate-rounds 1,2 --debate-lr-tag _paper_rounds --threads 1 --out "$OUT" || exit 1
echo "$(date -u +%T) start MAD rounds 1,2,3"
python -m eval.toys.mod --part mad-rounds --mad-rounds 1,2,3 --debate-test "$MAD_TEST" --threads 1 --out "$OUT" || exit 1
echo "$(date -u +%T) done"
