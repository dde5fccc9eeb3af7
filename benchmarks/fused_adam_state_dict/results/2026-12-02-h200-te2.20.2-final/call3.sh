#!/usr/bin/env bash
# Call 3: the resume with TE's load (quiet machine: benchmark_resume.py, standard and
# ParallelFileSystemReader), then TE's single-GPU FusedAdam tests of the stack and of PR 1 alone,
# the checks that the new tests fail where the code they test does not run (PR 1's tests on the
# earlier PR 1 whose threads set one intra-op thread; #3507's test on pristine TE), and the
# stager's GPU tests, side by side.
set -u
R=$PWD; L=/tmp/logs; mkdir -p $L; export PYTHONUNBUFFERED=1
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $L/summary.txt; }
t "install"; bash .te-kit/install.sh .te-kit /tmp/te-site > $L/install.log 2>&1 || { tail -30 $L/install.log; exit 1; }
for s in pristine pr1 stack oldpr1; do cp -a /tmp/te-site /tmp/site-$s; done
(cd /tmp/site-pr1 && git apply --include='transformer_engine/*' $R/patches/1-export/000[1-4]-*.patch) && t "pr1 applied"
(cd /tmp/site-stack && git apply --include='transformer_engine/*' $R/patches/1-export/000[1-4]-*.patch $R/patches/2-upstream-3507/0001-*.patch) && t "stack applied"
(cd /tmp/site-oldpr1 && git apply --include='transformer_engine/*' $R/.devrun/oldpr1/000[1-4]-*.patch) && t "earlier pr1 applied"
sha256sum /tmp/site-*/transformer_engine/pytorch/optimizers/fused_adam.py | tee -a $L/summary.txt
t "resume, quiet"
PYTHONPATH=/tmp/site-stack:$R torchrun --standalone --nproc_per_node=1 benchmarks/fused_adam_state_dict/benchmark_resume.py \
  --local-log2 29 --repeats 1 --ckpt-dir /dev/shm/resume --out $OUT/resume.jsonl > $L/resume.log 2>&1; t "resume rc=$?"
T=$R/.devrun/trees
single() {  # name site tree [pytest args]
  local n=$1 s=$2 tr=$3; shift 3; mkdir -p /tmp/single-$n; cd /tmp/single-$n
  start=$(date +%s)
  PYTHONPATH=$s timeout -k 10 300 python3 -m pytest -p no:cacheprovider -rs --tb=short \
    --junitxml=$L/single_$n.xml $tr/tests/pytorch/test_fused_optimizer.py "$@" > $L/single_$n.log 2>&1
  echo "single $n rc=$? $(( $(date +%s) - start )) s: $(tail -1 $L/single_$n.log)" | tee -a $L/summary.txt
}
single stack /tmp/site-stack $T/stack &
single pr1 /tmp/site-pr1 $T/pr1 &
single pr1-tests-on-earlier-pr1 /tmp/site-oldpr1 $T/pr1 -k "TestFusedAdamStateDictCPUOffload" &
single 3507-test-on-pristine /tmp/site-pristine $T/stack -k "TestFusedAdamLoadStateDict" &
( cd $R; start=$(date +%s); PYTHONPATH=/tmp/site-stack:$R timeout -k 10 420 torchrun --standalone --nproc_per_node=1 -m pytest -q -rs -p no:cacheprovider tests/staging > $L/staging.log 2>&1
  echo "tests/staging rc=$? $(( $(date +%s) - start )) s: $(tail -1 $L/staging.log)" | tee -a $L/summary.txt ) &
wait
t "all done"
cat $L/summary.txt
tar -czf $OUT/logs3.tgz -C /tmp logs
