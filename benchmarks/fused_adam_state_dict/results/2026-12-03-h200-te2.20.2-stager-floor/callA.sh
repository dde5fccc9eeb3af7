#!/usr/bin/env bash
# Call A (2026-12-03, fourth round): the final series on the GPU, and the least a DefaultStager
# checkpoint of the option's export can stall. Side by side: test_fused_optimizer.py of main +
# the stack, of main + PR 1 alone and PR 2 alone, PR 3's cases on TE + PR 3 alone; tests/staging; TE's L1 FSDP2
# FusedAdam selection at world size 2 on TE + the stack and on pristine TE (multirank-one-gpu,
# the 2026-12-03 pinning folder's ws2.sh); PR 2 alone. Then quiet: stager_floor.py (16 and 1
# threads); set_states.py on TE + PR 3 and on pristine TE, in turn, twice.
set -u; R=$PWD; L=$OUT; D=$R/benchmarks/fused_adam_state_dict/results/2026-12-03-h200-te2.20.2-stager-floor
W2=$R/benchmarks/fused_adam_state_dict/results/2026-12-03-h200-te2.20.2-pinning/ws2.sh
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $L/summary.txt; }
mkdir -p /tmp/logs; bash .te-kit/install.sh .te-kit /tmp/te-site > /tmp/logs/install.log 2>&1 || { tail -30 /tmp/logs/install.log; exit 1; }
python3 -c "import torch, transformer_engine; print('torch', torch.__version__)" 2>&1 | tail -1 | tee -a $L/summary.txt
for s in pristine pr1 pr2 pr3; do cp -a /tmp/te-site /tmp/site-$s; done
P=$R/patches
(cd /tmp/te-site && git apply --include='transformer_engine/*' $P/1-export/000[1-4]-*.patch $P/2-upstream-3507/0001-*.patch $P/3-bf16-load/0001-*.patch) && t "stack applied"
(cd /tmp/site-pr1 && git apply --include='transformer_engine/*' $P/1-export/000[1-4]-*.patch) && t "PR 1 alone applied"
(cd /tmp/site-pr2 && git apply --include='transformer_engine/*' $P/2-upstream-3507/0001-*.patch) && t "PR 2 alone applied"
(cd /tmp/site-pr3 && git apply --include='transformer_engine/*' $P/3-bf16-load/0001-*.patch) && t "PR 3 alone applied"
pt() { mkdir -p /tmp/run-$1; cd /tmp/run-$1; local s=$(date +%s); PYTHONPATH=$2 timeout -k 5 240 python3 -m pytest -p no:cacheprovider -rA --tb=short -q $3 "${@:4}" > /tmp/logs/$1.log 2>&1
  t "$1 rc=$? $(( $(date +%s) - s )) s: $(tail -1 /tmp/logs/$1.log)"; }
T=$R/.devrun/trees; export HARNESS=$R/.devrun/multirank
( cd $R; s=$(date +%s); PYTHONPATH=/tmp/te-site:$R timeout -k 10 330 torchrun --standalone --nproc_per_node=1 --master-port=29500 -m pytest -q -rs -p no:cacheprovider tests/staging > /tmp/logs/staging.log 2>&1
  t "tests/staging rc=$? $(( $(date +%s) - s )) s: $(tail -1 /tmp/logs/staging.log)" ) &
bash $W2 l1 stack /tmp/te-site $T/stack /tmp/logs 300 > /dev/null 2>&1 &
bash $W2 l1 pristine /tmp/site-pristine $T/pristine /tmp/logs 300 > /dev/null 2>&1 &
pt stack /tmp/te-site $T/stack/tests/pytorch/test_fused_optimizer.py &
pt pr1 /tmp/site-pr1 $T/pr1/tests/pytorch/test_fused_optimizer.py &
pt pr2 /tmp/site-pr2 $T/pr2/tests/pytorch/test_fused_optimizer.py &
pt pr3 /tmp/site-pr3 $T/pr3/tests/pytorch/test_fused_optimizer.py -k "TestFusedAdam or set_bf16" &
wait; cat /tmp/logs/summary.txt | tee -a $L/summary.txt; t "tests done"
grep -hE "^(FAILED|ERROR)" /tmp/logs/*.log | head -20 | tee -a $L/summary.txt
grep -h "state_dict_cpu_offload_dcp" /tmp/logs/l1_stack.log | grep -E "PASSED|FAILED|SKIPPED" | head -8 | tee -a $L/summary.txt
cd $D; PYTHONPATH=/tmp/te-site timeout 200 python3 stager_floor.py --threads 16 1 --repeats 3 > $L/floor.jsonl 2>/tmp/logs/floor.err; t "stager_floor rc=$?"
cat $L/floor.jsonl; tail -5 /tmp/logs/floor.err
for s in pristine pr3 pristine pr3; do PYTHONPATH=/tmp/site-$s timeout 60 python3 set_states.py >> $L/set_states.jsonl 2>>/tmp/logs/set_states.err; done; t "set_states rc=$?"
cat $L/set_states.jsonl; tail -3 /tmp/logs/set_states.err
cp /tmp/logs/staging.log $L/; tar czf $L/logs.tgz -C /tmp logs
