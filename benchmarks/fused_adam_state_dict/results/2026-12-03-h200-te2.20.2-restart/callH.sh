#!/usr/bin/env bash
# Call H (2026-12-03): PR 1's pool under torchrun, side by side in one run: 8 processes at once
# on the one GPU (OMP_NUM_THREADS=1, 2^27 elements each, BF16/FP16/FP8 moments), each export
# through TE's rule (2 threads each here), through no thread (the calling thread with its one
# intra-op thread), and today's export (state_dict() then .cpu()); 2 rounds each, twice.
set -u; R=$PWD; L=$OUT; E=$R/benchmarks/fused_adam_state_dict/results/2026-12-03-h200-te2.20.2-bounded-threads/export_threads.py
export PYTHONUNBUFFERED=1; T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $L/summary.txt; }
bash .te-kit/install.sh .te-kit /tmp/te-site > /tmp/install.log 2>&1 || { tail -30 /tmp/install.log; exit 1; }
(cd /tmp/te-site && git apply --include='transformer_engine/*' $R/patches/1-export/000[1-4]-*.patch) && t "PR 1 applied"
export PYTHONPATH=/tmp/te-site
X="timeout 80 torchrun --nproc_per_node=8 --master-port=29400 $E --rounds 2 --out $L/export8.jsonl"
for pass in 1 2; do
  $X --designs te > /tmp/rule$pass.log 2>&1; t "pass $pass rule rc=$?"
  $X --designs te --pool 0 > /tmp/none$pass.log 2>&1; t "pass $pass no thread rc=$?"
done
$X --designs default --default-rounds 2 > /tmp/default.log 2>&1; t "today rc=$?"
tail -5 /tmp/none1.log
python3 -c "
import json
for l in open('$L/export8.jsonl'):
    r=json.loads(l); print(r.get('design'), r.get('moments'), r.get('procs'), r.get('round'), r.get('threads'), r.get('rule'), r.get('GBps'), r.get('same'))"
