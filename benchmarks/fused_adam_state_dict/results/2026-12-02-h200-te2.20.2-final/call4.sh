#!/usr/bin/env bash
# Call 4: after the reader's torch-2.11 fix: the resume with TE's load (quiet machine), then the
# stager's GPU tests.
set -u
R=$PWD; L=/tmp/logs; mkdir -p $L; export PYTHONUNBUFFERED=1
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $L/summary.txt; }
bash .te-kit/install.sh .te-kit /tmp/te-site > $L/install.log 2>&1 || { tail -30 $L/install.log; exit 1; }
(cd /tmp/te-site && git apply --include='transformer_engine/*' $R/patches/1-export/000[1-4]-*.patch $R/patches/2-upstream-3507/0001-*.patch) && t "stack applied"
sha256sum /tmp/te-site/transformer_engine/pytorch/optimizers/fused_adam.py | tee -a $L/summary.txt
export PYTHONPATH=/tmp/te-site:$R
timeout -k 5 95 torchrun --standalone --nproc_per_node=1 benchmarks/fused_adam_state_dict/benchmark_resume.py \
  --local-log2 29 --repeats 1 --ckpt-dir /dev/shm/resume --out $OUT/resume.jsonl > $L/resume.log 2>&1; t "resume rc=$?"
cat $OUT/resume.jsonl
timeout -k 5 195 torchrun --standalone --nproc_per_node=1 -m pytest -q -rs -p no:cacheprovider tests/staging > $L/staging.log 2>&1
t "tests/staging rc=$?: $(grep -E 'passed|failed' $L/staging.log | tail -1)"
tar -czf $OUT/logs4.tgz -C /tmp logs
