#!/usr/bin/env bash
# Call 7 (2026-12-03): PR 1 with its final thread rule (at most CPUs / LOCAL_WORLD_SIZE /
# intra-op threads; none where that is 1). Quiet first: the export at 2^30, one process (16
# intra-op threads: no thread) beside today's, and 8 processes (OMP_NUM_THREADS=1: 2 each).
# Then side by side: the single-GPU tests of the stack and of PR 1 alone, the stager's GPU tests.
set -u
R=$PWD; L=/tmp/logs; mkdir -p $L; export PYTHONUNBUFFERED=1
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $L/summary.txt; }
t "install"; bash .te-kit/install.sh .te-kit /tmp/te-site > $L/install.log 2>&1 || { tail -30 $L/install.log; exit 1; }
for s in pr1 stack; do cp -a /tmp/te-site /tmp/site-$s; done
(cd /tmp/site-pr1 && git apply --include='transformer_engine/*' $R/patches/1-export/000[1-4]-*.patch) && t "pr1 applied"
(cd /tmp/site-stack && git apply --include='transformer_engine/*' $R/patches/1-export/000[1-4]-*.patch $R/patches/2-upstream-3507/0001-*.patch) && t "stack applied"
sha256sum /tmp/site-*/transformer_engine/pytorch/optimizers/fused_adam.py | tee -a $L/summary.txt
t "export: the rule, with today's"
PYTHONPATH=/tmp/site-stack timeout 150 python3 .devrun/export_threads.py --out $OUT/export.jsonl --rounds 3 --designs default te > $L/export_rule.log 2>&1 || tail -20 $L/export_rule.log
t "export: 8 processes"
PYTHONPATH=/tmp/site-stack timeout 60 torchrun --nproc_per_node=8 --master-port=29400 .devrun/export_threads.py --designs te --rounds 2 --out $OUT/export.jsonl > $L/export8.log 2>&1 || tail -20 $L/export8.log
t "tests"
T=$R/.devrun/trees
single() {  # name site tree [extra pytest args]
  local n=$1 s=$2 tr=$3; shift 3; mkdir -p /tmp/single-$n; cd /tmp/single-$n
  start=$(date +%s)
  PYTHONPATH=$s timeout -k 10 200 python3 -m pytest -p no:cacheprovider -rs --tb=short \
    --junitxml=$L/single_$n.xml $tr/tests/pytorch/test_fused_optimizer.py "$@" > $L/single_$n.log 2>&1
  echo "single $n rc=$? $(( $(date +%s) - start )) s: $(tail -1 $L/single_$n.log)" | tee -a $L/summary.txt
}
single stack /tmp/site-stack $T/stack &
single pr1 /tmp/site-pr1 $T/pr1 &
( cd $R; start=$(date +%s); PYTHONPATH=/tmp/site-stack:$R timeout -k 10 285 torchrun --standalone --nproc_per_node=1 -m pytest -q -rs -p no:cacheprovider tests/staging > $L/staging.log 2>&1
  echo "tests/staging rc=$? $(( $(date +%s) - start )) s: $(tail -1 $L/staging.log)" | tee -a $L/summary.txt ) &
wait
t "all done"
cat $L/summary.txt
grep -E "FAILED|Error" $L/single_*.log $L/staging.log | head -20
tar -czf $OUT/logs7.tgz -C /tmp logs
