#!/usr/bin/env bash
# The MoD debate part's main setting (pre-registered in eval/logs/mod.md): 600 test questions, 500 steps, every arm at its validated lr, seeds 0-2, MoD-Multi
# 2 and 3 rounds. Two processes, one thread each:   bash eval/toys/mod_main.sh a   and   ... b
# Each (arm, seed) is its own call; an optional run-length limit MAX_MINUTES=N (unset: none) is
# checked before every training; everything on disk is reused, so a stopped run resumes.
# The report over everything on disk:   bash eval/toys/mod_main.sh report
set -u
OUT=${OUT:-out/mod}; MAX_MINUTES=${MAX_MINUTES:-}; START=$(date +%s)
M="python -m eval.toys.mod --part debate-lr --debate-test 600 --threads 1 --out $OUT"
export OMP_NUM_THREADS=1
late() { [ -n "$MAX_MINUTES" ] && [ $(( $(date +%s) - START )) -ge $(( MAX_MINUTES * 60 )) ]; }
one() {  # one (arm=lr, seed) at 500 steps; extra flags after the seed
  local pick=$1 seed=$2; shift 2
  if late; then echo "$(date -u +%T) MAX_MINUTES reached: $pick seed $seed not run"; return; fi
  echo "$(date -u +%T) start $pick seed $seed $*"
  $M --debate-steps 500 --debate-picks "$pick" --debate-seeds "$seed" --debate-lr-tag _step "$@" || exit 1
}
mixpick() {  # the data-mix arm's lr picked by the sweep
  python -c "import json,sys; print(json.load(open('$OUT/debate/lr/results_mix_sweep.json'))['picks'][sys.argv[1]])" "$1"
}
case ${1:-} in
  a)
    until [ -f "$OUT/debate/lr/base_val.json" ]; do sleep 20; done   # b makes prep.json and the val scores first
    for s in 0 1 2; do for p in MoD=1e-2 MoE-LoRA=5e-3 LoRA=5e-3; do one $p $s; done; done
    for s in 0 1 2; do one MoD=1e-2 $s --debate-rounds 2,3; done
    for s in 0 1 2; do one MoE-LoRA_window=5e-3 $s; done ;;
  b)
    $M --debate-arms MoD_pos,MoD_pos_rev --debate-seeds 0 --debate-lr-tag _mix_sweep || exit 1
    P1=$(mixpick "MoD T_pos only"); P2=$(mixpick "MoD T_pos+T_rev")
    for s in 0 1 2; do one MoD_pos=$P1 $s; one MoD_pos_rev=$P2 $s; done
    for p in LoRA_r4=1e-2 MoD_shared=1e-2; do for s in 0 1 2; do one $p $s; done; done ;;
  report)
    P1=$(mixpick "MoD T_pos only"); P2=$(mixpick "MoD T_pos+T_rev")
    $M --debate-steps 500 --debate-seeds 0,1,2 --debate-rounds 2,3 --debate-no-train --debate-lr-tag _main \
       --debate-picks MoD=1e-2,MoE-LoRA=5e-3,LoRA=5e-3,LoRA_r4=1e-2,MoE-LoRA_window=5e-3,MoD_shared=1e-2,MoD_pos=$P1,MoD_pos_rev=$P2 ;;
  *) echo "usage: bash eval/toys/mod_main.sh a|b|report" >&2; exit 2 ;;
esac
echo "$(date -u +%T) done $1"
