#!/usr/bin/env bash
# Call A (2026-12-03, third round): the tests first, at once: tests/staging after the reader's
# last change (549595d); PR 3's final code (the is_cuda guard) on TE + PR 3 alone, on a mutant
# without its pinned branch (its [pinned] case must fail), and test_fused_optimizer.py of main
# + the stack. Then, quiet, one after the other: pin_ways.py (ways to pin the template's 7 GiB)
# and the resume with the final PR 3 (benchmark_resume.py, register + huge).
set -u; R=$PWD; L=$OUT; D=$R/benchmarks/fused_adam_state_dict/results/2026-12-03-h200-te2.20.2-pinning
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $L/summary.txt; }
mkdir -p /tmp/logs; bash .te-kit/install.sh .te-kit /tmp/te-site > /tmp/logs/install.log 2>&1 || { tail -30 /tmp/logs/install.log; exit 1; }
F=transformer_engine/pytorch/optimizers/fused_adam.py
cp -a /tmp/te-site /tmp/site-pr3
(cd /tmp/te-site && git apply --include='transformer_engine/*' $R/patches/1-export/000[1-4]-*.patch $R/patches/2-upstream-3507/0001-*.patch $R/patches/3-bf16-load/0001-*.patch) && t "stack applied"
(cd /tmp/site-pr3 && git apply --include='transformer_engine/*' $R/patches/3-bf16-load/0001-*.patch) && t "PR 3 alone applied"
cp -a /tmp/site-pr3 /tmp/site-nobranch
sed -i 's/            if not unscaled_state.is_cuda and unscaled_state.is_pinned():.*/            if False:  # mutant/' /tmp/site-nobranch/$F
t "mutant nobranch: $(diff /tmp/site-pr3/$F /tmp/site-nobranch/$F | grep -c '^>') line(s) changed"
pt() { mkdir -p /tmp/run-$1; cd /tmp/run-$1; local s=$(date +%s); PYTHONPATH=$2 timeout -k 5 200 python3 -m pytest -p no:cacheprovider -rA --tb=line -q $3 "${@:4}" > /tmp/logs/$1.log 2>&1
  t "$1 rc=$? $(( $(date +%s) - s )) s: $(tail -1 /tmp/logs/$1.log)"; }
T=$R/.devrun/trees
( cd $R; s=$(date +%s); PYTHONPATH=/tmp/te-site:$R timeout -k 10 300 torchrun --standalone --nproc_per_node=1 -m pytest -q -rs -p no:cacheprovider tests/staging > /tmp/logs/staging.log 2>&1
  t "tests/staging rc=$? $(( $(date +%s) - s )) s: $(tail -1 /tmp/logs/staging.log)" ) &
pt stack /tmp/te-site $T/stack/tests/pytorch/test_fused_optimizer.py &
pt pr3 /tmp/site-pr3 $T/pr3/tests/pytorch/test_fused_optimizer.py -k "TestFusedAdam or set_bf16" &
pt nobranch /tmp/site-nobranch $T/pr3/tests/pytorch/test_fused_optimizer.py -k set_bf16 &
wait
for f in stack pr3 nobranch; do grep -E "^(PASSED|FAILED).*set_bf16" /tmp/logs/$f.log | sed "s|::| |; s|^\([A-Z]*\) .* |$f \1 |"; done | tee -a $L/summary.txt
grep -hE "^(FAILED|ERROR)" /tmp/logs/stack.log /tmp/logs/pr3.log /tmp/logs/staging.log | head
cd $D; REG=pinned_use_cuda_host_register:True,pinned_num_register_threads:16; HUGE=glibc.malloc.hugetlb=1
python3 pin_ways.py --make-file /tmp/pin_ways.bin && sync && t "file made"
P="timeout 60 python3 pin_ways.py"
for rep in 1 2; do
  GLIBC_TUNABLES=$HUGE PYTORCH_CUDA_ALLOC_CONF=$REG $P --way torch --threads 1
  GLIBC_TUNABLES=$HUGE PYTORCH_CUDA_ALLOC_CONF=$REG $P --way torch --threads 8
  GLIBC_TUNABLES=$HUGE $P --way register --threads 1
  GLIBC_TUNABLES=$HUGE $P --way register --threads 16
  GLIBC_TUNABLES=$HUGE PYTORCH_CUDA_ALLOC_CONF=$REG $P --way read --file /tmp/pin_ways.bin
  GLIBC_TUNABLES=$HUGE $P --way overlap --threads 1 --file /tmp/pin_ways.bin
  GLIBC_TUNABLES=$HUGE $P --way overlap --threads 4 --file /tmp/pin_ways.bin
done >> $L/pin_ways.jsonl 2>>/tmp/logs/pin_ways.err; t "pin_ways rc=$?"; rm -f /tmp/pin_ways.bin
cat $L/pin_ways.jsonl; tail -5 /tmp/logs/pin_ways.err
cd $R/benchmarks/fused_adam_state_dict; export PYTHONPATH=/tmp/te-site:$R
GLIBC_TUNABLES=$HUGE PYTORCH_CUDA_ALLOC_CONF=$REG timeout 150 torchrun --standalone --nproc_per_node=1 benchmark_resume.py --local-log2 29 --repeats 2 --out $L/resume.jsonl > /tmp/logs/resume.log 2>&1; t "resume register+huge rc=$?"
python3 -c "
import json
for l in open('$L/resume.jsonl'):
    r=json.loads(l); print(r['variant'], r['cold'], r.get('template_s'), r.get('dcp_load_s'), r.get('set_s'), r.get('total_s'), r.get('bitwise'), r.get('host_peak_GiB'), r.get('next_stage_s'), r.get('next_reused'))" | tee -a $L/summary.txt
cp /tmp/logs/staging.log $L/; tar czf $L/logs.tgz -C /tmp logs
