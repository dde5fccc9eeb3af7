#!/usr/bin/env bash
# Call 2: the stack as it now is (PR 1 reworked + #3507's load) and PR 1 alone, beside pristine TE:
# the export of the final code (quiet machine), then TE's single-GPU FusedAdam tests, the L1 FSDP2
# file at world size 2 and DP4 -> DP2 resharding (multirank-one-gpu), TE's TestFusedAdam with the
# option forced on, the stager's GPU tests and gpu_check, side by side.
set -u
R=$PWD; L=/tmp/logs; mkdir -p $L; export PYTHONUNBUFFERED=1
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $L/summary.txt; }
t "install"; bash .te-kit/install.sh .te-kit /tmp/te-site > $L/install.log 2>&1 || { tail -30 $L/install.log; exit 1; }
for s in pristine pr1 stack; do cp -a /tmp/te-site /tmp/site-$s; done
(cd /tmp/site-pr1 && git apply --include='transformer_engine/*' $R/patches/1-export/000[1-4]-*.patch) && t "pr1 applied"
(cd /tmp/site-stack && git apply --include='transformer_engine/*' $R/patches/1-export/000[1-4]-*.patch $R/patches/2-load-without-casts/0001-*.patch) && t "stack applied"
sha256sum /tmp/site-*/transformer_engine/pytorch/optimizers/fused_adam.py | tee -a $L/summary.txt
t "export, one process"
PYTHONPATH=/tmp/site-stack python3 .devrun/export_threads.py --designs default te --out $OUT/export_final.jsonl > $L/export1.log 2>&1 || tail -20 $L/export1.log
t "export, 8 processes"
PYTHONPATH=/tmp/site-stack torchrun --nproc_per_node=8 --master-port=29400 .devrun/export_threads.py --designs default te --out $OUT/export_final.jsonl > $L/export8.log 2>&1 || tail -20 $L/export8.log
t "tests"
T=$R/.devrun/trees
bash .devrun/ws2.sh l1 pristine /tmp/site-pristine $T/pristine $L 330 &
bash .devrun/ws2.sh l1 pr1 /tmp/site-pr1 $T/pr1 $L 330 &
bash .devrun/ws2.sh l1 stack /tmp/site-stack $T/stack $L 330 &
bash .devrun/ws2.sh reshard pr1 /tmp/site-pr1 $T/pr1 $L DelayedScaling Float8CurrentScaling Float8BlockScaling &
( bash .devrun/ws2.sh reshard stack /tmp/site-stack $T/stack $L DelayedScaling Float8CurrentScaling Float8BlockScaling
  FORCED_SITE=$R/.devrun/force_offload.py bash .devrun/ws2.sh reshard stack-forced /tmp/site-stack $T/stack $L DelayedScaling ) &
single() {  # name site tree [extra pytest args]
  local n=$1 s=$2 tr=$3; shift 3; mkdir -p /tmp/single-$n; cd /tmp/single-$n
  start=$(date +%s)
  PYTHONPATH=$R/.devrun/multirank:$s timeout -k 10 380 python3 -m pytest -p no:cacheprovider -rs --tb=short \
    --junitxml=$L/single_$n.xml $tr/tests/pytorch/test_fused_optimizer.py "$@" > $L/single_$n.log 2>&1
  echo "single $n rc=$? $(( $(date +%s) - start )) s: $(tail -1 $L/single_$n.log)" | tee -a $L/summary.txt
}
single stack /tmp/site-stack $T/stack &
single pr1 /tmp/site-pr1 $T/pr1 &
FORCED_SITE=$R/.devrun/force_offload.py single stack-forced /tmp/site-stack $T/stack -k "TestFusedAdam and not StateDict and not LoadStateDict" &
( cd $R; start=$(date +%s); PYTHONPATH=/tmp/site-stack:$R timeout -k 10 380 torchrun --standalone --nproc_per_node=1 -m pytest -q -rs -p no:cacheprovider tests/staging > $L/staging.log 2>&1
  echo "tests/staging rc=$? $(( $(date +%s) - start )) s: $(tail -1 $L/staging.log)" | tee -a $L/summary.txt ) &
( cd $R; PYTHONPATH=/tmp/site-stack:$R python3 -m te_fusedadam_offload.gpu_check > $L/gpu_check.log 2>&1; echo "gpu_check rc=$?" | tee -a $L/summary.txt; cat $L/gpu_check.log ) &
wait
t "all done"
cat $L/summary.txt
tar -czf $OUT/logs2.tgz -C /tmp logs
