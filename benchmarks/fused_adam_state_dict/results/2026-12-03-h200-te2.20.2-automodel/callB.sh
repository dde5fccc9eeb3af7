#!/usr/bin/env bash
# Call B (2026-12-03): the tests of the series as it is (the edits after 2026-12-03's third
# review not run on a GPU before), side by side: TE's single-GPU optimizer tests on the stack, on
# PR 1 alone and on PR 2 alone; the L1 FSDP2 FusedAdam file at world size 2 and DP4 -> DP2
# resharding (DelayedScaling) on the stack (multirank-one-gpu, .devrun/ws2.sh = 2026-12-02's
# multirank/ws2.sh); the stager's and reader's GPU tests (tests/staging). Test trees: main's
# tests with each PR's test patches applied (.devrun/trees/NAME).
set -u
R=$PWD; L=/tmp/logs; mkdir -p $L; export PYTHONUNBUFFERED=1
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $L/summary.txt; }
t "install"; bash .te-kit/install.sh .te-kit /tmp/te-site > $L/install.log 2>&1 || { tail -30 $L/install.log; exit 1; }
for s in pr1 pr2 stack; do cp -a /tmp/te-site /tmp/site-$s; done
(cd /tmp/site-pr1 && git apply --include='transformer_engine/*' $R/patches/1-export/000[1-4]-*.patch) && t "pr1 applied"
(cd /tmp/site-pr2 && git apply --include='transformer_engine/*' $R/patches/2-upstream-3507/0001-*.patch) && t "pr2 applied"
(cd /tmp/site-stack && git apply --include='transformer_engine/*' $R/patches/1-export/000[1-4]-*.patch $R/patches/2-upstream-3507/0001-*.patch) && t "stack applied"
sha256sum /tmp/site-*/transformer_engine/pytorch/optimizers/fused_adam.py | tee -a $L/summary.txt
T=$R/.devrun/trees
bash .devrun/ws2.sh l1 stack /tmp/site-stack $T/stack $L 330 &
bash .devrun/ws2.sh reshard stack /tmp/site-stack $T/stack $L DelayedScaling &
single() {  # name site tree [extra pytest args]
  local n=$1 s=$2 tr=$3; shift 3; mkdir -p /tmp/single-$n; cd /tmp/single-$n
  start=$(date +%s)
  PYTHONPATH=$s timeout -k 10 300 python3 -m pytest -p no:cacheprovider -rs --tb=short \
    --junitxml=$L/single_$n.xml $tr/tests/pytorch/test_fused_optimizer.py "$@" > $L/single_$n.log 2>&1
  echo "single $n rc=$? $(( $(date +%s) - start )) s: $(tail -1 $L/single_$n.log)" | tee -a $L/summary.txt
}
single stack /tmp/site-stack $T/stack &
single pr1 /tmp/site-pr1 $T/pr1 &
single pr2 /tmp/site-pr2 $T/pr2 &
( cd $R; start=$(date +%s); PYTHONPATH=/tmp/site-stack:$R timeout -k 10 300 torchrun --standalone --nproc_per_node=1 -m pytest -q -rs -p no:cacheprovider tests/staging > $L/staging.log 2>&1
  echo "tests/staging rc=$? $(( $(date +%s) - start )) s: $(tail -1 $L/staging.log)" | tee -a $L/summary.txt ) &
wait
t "all done"
cat $L/summary.txt
grep -E "FAILED|Error" $L/single_*.log $L/staging.log $L/l1_*.log | head -20
tar -czf $OUT/logsB.tgz -C /tmp logs
