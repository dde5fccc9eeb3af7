#!/usr/bin/env bash
# ws2.sh MODE NAME SITE TESTS LOGDIR [ARGS]: with N ranks on one GPU (multirank-one-gpu), the TE
# under SITE and the test files under TESTS/tests/pytorch (copied; their /tmp paths made per run):
#   l1 ... TIMEOUT        TE's L1 FSDP2 FusedAdam selection at world size 2, less
#                         safetensors_fp32_export (it crashes under gloo on pristine TE too)
#   reshard ... RECIPE..  DP4 -> DP2 resharding per recipe (save at 4 ranks, load at 2)
# HARNESS: the directory of multirank-one-gpu's sitecustomize.py
MODE=$1 NAME=$2 SITE=$3 TESTS=$4 LOG=$5; shift 5
W=/tmp/ws-$NAME-$MODE; rm -rf $W; mkdir -p $W/tmp; cp -r $TESTS/tests $W/
grep -rl "/tmp/te_test_" $W/tests | xargs sed -i "s|/tmp/te_test_|$W/tmp/te_test_|g"
export SHARE_GPU=1 PYTHONPATH=$HARNESS:$SITE:$W/tests/pytorch PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=$W/inductor
cd $W/tests/pytorch/distributed/fsdp2_tests
port=$((20000 + RANDOM % 20000))
if [ $MODE = l1 ]; then
  start=$(date +%s)
  timeout -k 10 $1 torchrun --nproc_per_node=2 --master-port=$port --local-ranks-filter=0 -m pytest \
    run_fsdp2_fused_adam.py -v -s --tb=short -p no:cacheprovider --junitxml=$LOG/l1_$NAME.xml \
    -k "not hybrid and not dcp_resharding_save and not dcp_resharding_load and not safetensors_fp32_export" \
    > $LOG/l1_$NAME.log 2>&1
  echo "L1 $NAME rc=$? $(( $(date +%s) - start )) s: $(grep -E '^=+ .*(passed|failed).* =+$' $LOG/l1_$NAME.log | tail -1)" | tee -a $LOG/summary.txt
else
  for recipe in "$@"; do
    start=$(date +%s)
    timeout -k 10 150 torchrun --nproc_per_node=4 --master-port=$port --local-ranks-filter=0 \
      run_fsdp2_fused_adam.py --test dcp_resharding_save --recipe $recipe > $LOG/reshard_${NAME}_$recipe.log 2>&1
    s=$?
    timeout -k 10 150 torchrun --nproc_per_node=2 --master-port=$((port+1)) --local-ranks-filter=0 \
      run_fsdp2_fused_adam.py --test dcp_resharding_load --recipe $recipe >> $LOG/reshard_${NAME}_$recipe.log 2>&1
    echo "reshard $NAME $recipe save rc=$s load rc=$? $(( $(date +%s) - start )) s" | tee -a $LOG/summary.txt
  done
fi
