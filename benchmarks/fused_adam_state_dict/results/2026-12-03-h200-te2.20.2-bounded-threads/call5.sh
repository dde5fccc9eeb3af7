#!/usr/bin/env bash
# Call 5 (2026-12-03): PR 1 with its threads bounded by the intra-op threads and the atexit
# fallback. First, quiet: the export at 2^30 in one process with TE's new rule (1 thread x 16
# intra-op on this 16-CPU host) beside the rule of before (16 x 16), 2 x 16 and no thread, and
# 8 processes at once (OMP_NUM_THREADS=1: 16 threads each, as before). Then side by side: the
# single-GPU tests of the stack and of PR 1 alone, the new tests on the PR 1 of before (they must
# fail), the L1 FSDP2 file at world size 2 and DP4 -> DP2 resharding (multirank-one-gpu) on PR 1
# and the stack, TE's TestFusedAdam with the option forced on, the stager's GPU tests, gpu_check.
set -u
R=$PWD; L=/tmp/logs; mkdir -p $L; export PYTHONUNBUFFERED=1
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $L/summary.txt; }
t "install"; bash .te-kit/install.sh .te-kit /tmp/te-site > $L/install.log 2>&1 || { tail -30 $L/install.log; exit 1; }
for s in pr1 stack prevpr1; do cp -a /tmp/te-site /tmp/site-$s; done
(cd /tmp/site-pr1 && git apply --include='transformer_engine/*' $R/patches/1-export/000[1-4]-*.patch) && t "pr1 applied"
(cd /tmp/site-stack && git apply --include='transformer_engine/*' $R/patches/1-export/000[1-4]-*.patch $R/patches/2-upstream-3507/0001-*.patch) && t "stack applied"
(cd /tmp/site-prevpr1 && git apply --include='transformer_engine/*' $R/.devrun/prevpr1/000[1-4]-*.patch) && t "previous pr1 applied"
sha256sum /tmp/site-*/transformer_engine/pytorch/optimizers/fused_adam.py | tee -a $L/summary.txt
nproc | tee -a $L/summary.txt
E="PYTHONPATH=/tmp/site-stack python3 .devrun/export_threads.py --out $OUT/export.jsonl --rounds 3"
t "export: the rule, with today's"; eval $E --designs default te > $L/export_rule.log 2>&1 || tail -20 $L/export_rule.log
t "export: 16 threads (before)"; eval $E --designs te --pool 16 > $L/export_16.log 2>&1 || tail -20 $L/export_16.log
t "export: no thread"; eval $E --designs te --pool 0 --moments bf16 > $L/export_0.log 2>&1 || tail -20 $L/export_0.log
t "export: 8 processes"
PYTHONPATH=/tmp/site-stack torchrun --nproc_per_node=8 --master-port=29400 .devrun/export_threads.py --designs te --rounds 2 --out $OUT/export.jsonl > $L/export8.log 2>&1 || tail -20 $L/export8.log
t "export: 8 processes, 16 threads each (before)"
PYTHONPATH=/tmp/site-stack torchrun --nproc_per_node=8 --master-port=29401 .devrun/export_threads.py --designs te --rounds 2 --pool 16 --out $OUT/export.jsonl > $L/export8_16.log 2>&1 || tail -20 $L/export8_16.log
t "tests"
T=$R/.devrun/trees
bash .devrun/ws2.sh l1 pr1 /tmp/site-pr1 $T/pr1 $L 330 &
bash .devrun/ws2.sh l1 stack /tmp/site-stack $T/stack $L 330 &
bash .devrun/ws2.sh reshard pr1 /tmp/site-pr1 $T/pr1 $L DelayedScaling Float8CurrentScaling Float8BlockScaling &
( bash .devrun/ws2.sh reshard stack /tmp/site-stack $T/stack $L DelayedScaling Float8CurrentScaling Float8BlockScaling
  FORCED_SITE=$R/.devrun/force_offload.py bash .devrun/ws2.sh reshard stack-forced /tmp/site-stack $T/stack $L DelayedScaling ) &
single() {  # name site tree [extra pytest args]
  local n=$1 s=$2 tr=$3; shift 3; mkdir -p /tmp/single-$n; cd /tmp/single-$n
  start=$(date +%s)
  PYTHONPATH=$R/.devrun/multirank:$s timeout -k 10 300 python3 -m pytest -p no:cacheprovider -rs --tb=short \
    --junitxml=$L/single_$n.xml $tr/tests/pytorch/test_fused_optimizer.py "$@" > $L/single_$n.log 2>&1
  echo "single $n rc=$? $(( $(date +%s) - start )) s: $(tail -1 $L/single_$n.log)" | tee -a $L/summary.txt
}
single stack /tmp/site-stack $T/stack &
single pr1 /tmp/site-pr1 $T/pr1 &
single new-tests-on-previous-pr1 /tmp/site-prevpr1 $T/pr1 -k "test_export_at_exit or test_threads" &
FORCED_SITE=$R/.devrun/force_offload.py single stack-forced /tmp/site-stack $T/stack -k "TestFusedAdam and not StateDict and not LoadStateDict" &
( cd $R; start=$(date +%s); PYTHONPATH=/tmp/site-stack:$R timeout -k 10 330 torchrun --standalone --nproc_per_node=1 -m pytest -q -rs -p no:cacheprovider tests/staging > $L/staging.log 2>&1
  echo "tests/staging rc=$? $(( $(date +%s) - start )) s: $(tail -1 $L/staging.log)" | tee -a $L/summary.txt ) &
( cd $R; PYTHONPATH=/tmp/site-stack:$R python3 -m te_fusedadam_offload.gpu_check > $L/gpu_check.log 2>&1; echo "gpu_check rc=$?" | tee -a $L/summary.txt ) &
wait
t "all done"
cat $L/summary.txt
tar -czf $OUT/logs5.tgz -C /tmp logs
