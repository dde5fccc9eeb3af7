#!/usr/bin/env bash
# Call D (2026-12-03, third round): PR 3's test measuring GPU memory from before the set (in
# call C, after the mutant's failed case, memory freed during a set was counted), on TE + PR 3
# alone and on the three mutants of call C.
set -u; R=$PWD; L=$OUT; T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $L/summary.txt; }
mkdir -p /tmp/logs; bash .te-kit/install.sh .te-kit /tmp/te-site > /tmp/logs/install.log 2>&1 || { tail -30 /tmp/logs/install.log; exit 1; }
F=transformer_engine/pytorch/optimizers/fused_adam.py
(cd /tmp/te-site && git apply --include='transformer_engine/*' $R/patches/3-bf16-load/0001-*.patch) && t "PR 3 alone applied"
for m in whole nobranch nocontig; do cp -a /tmp/te-site /tmp/site-$m; done
sed -i 's/                piece = 4 \* 1024 \* 1024$/                piece = 1 << 40  # mutant/' /tmp/site-whole/$F
sed -i 's/                not unscaled_state.is_cuda$/                False  # mutant/' /tmp/site-nobranch/$F
sed -i '/                and unscaled_state.is_contiguous()$/d; /                and scaled_state.is_contiguous()$/d' /tmp/site-nocontig/$F
pt() { mkdir -p /tmp/run-$1; cd /tmp/run-$1; PYTHONPATH=$2 timeout -k 5 100 python3 -m pytest -p no:cacheprovider -rA --tb=line -q $R/.devrun/trees/pr3/tests/pytorch/test_fused_optimizer.py -k set_bf16 > /tmp/logs/$1.log 2>&1
  t "$1 rc=$?: $(tail -1 /tmp/logs/$1.log)"; grep -E "^(PASSED|FAILED)" /tmp/logs/$1.log | sed "s|^\([A-Z]*\) .*::|$1 \1 |" | tee -a $L/summary.txt; }
pt pr3 /tmp/te-site & for m in whole nobranch nocontig; do pt $m /tmp/site-$m & done; wait
tar czf $L/logs.tgz -C /tmp logs
