#!/usr/bin/env bash
# Call 1: TE 2.20.2 from the kit; the export's thread designs (quiet machine); then pristine TE's
# L1 FSDP2 file at world size 2 + DP4 -> DP2 resharding (background) beside the whole-resume
# GPU peaks of the current stack (TE's load against load_state_dict_in_place).
set -u
R=$PWD; L=/tmp/logs; mkdir -p $L; export PYTHONUNBUFFERED=1
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $L/summary.txt; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a $L/summary.txt
t "install"
KEEP_WHEEL=$OUT bash .te-kit/install.sh .te-kit /tmp/te-site > $L/install.log 2>&1 || { tail -30 $L/install.log; exit 1; }
cp -a /tmp/te-site /tmp/site-pristine; cp -a /tmp/te-site /tmp/site-stack
(cd /tmp/site-stack && git apply --include='transformer_engine/*' $R/patches/1-export/000[1-4]-*.patch \
   $R/patches/2-load-without-casts/0001-*.patch $R/patches/3-bounded-load/0001-*.patch) && t "stack applied"
sha256sum /tmp/site-*/transformer_engine/pytorch/optimizers/fused_adam.py | tee -a $L/summary.txt
python3 -c "import torch; print('torch', torch.__version__)" | tee -a $L/summary.txt
export PYTHONPATH=/tmp/site-stack:$R
t "export designs, one process"
python3 .devrun/export_threads.py --out $OUT/export_threads.jsonl > $L/export1.log 2>&1 || tail -20 $L/export1.log
t "export designs, 8 processes"
torchrun --nproc_per_node=8 --master-port=29400 .devrun/export_threads.py --out $OUT/export_threads.jsonl > $L/export8.log 2>&1 || tail -20 $L/export8.log
t "pristine L1 + resharding (background); whole resume"
( PYTHONPATH= bash .devrun/ws2.sh pristine /tmp/site-pristine $R/.devrun/trees/pristine $L 300 ) &
ws=$!
C=/dev/shm/resume; rm -rf $C
resume() {  # config
  torchrun --nproc_per_node=1 --master-port=$((29100 + RANDOM % 300)) .devrun/whole_resume.py --phase save --config $1 --ckpt $C >> $L/resume_$1.log 2>&1
  for load in te in_place; do
    torchrun --nproc_per_node=1 --master-port=$((29100 + RANDOM % 300)) .devrun/whole_resume.py --phase resume --config $1 --load $load --ckpt $C --out $OUT/whole_resume.jsonl >> $L/resume_$1.log 2>&1 || echo "resume $1 $load failed" >> $L/summary.txt
  done
  rm -rf $C/$1
}
resume bf16; t "bf16 done"
( resume fp16 & resume fp8 & resume fp16_master & wait )
t "resume rows done"
wait $ws; t "all done"
cat $L/summary.txt
tar -czf $OUT/logs1.tgz -C /tmp logs
