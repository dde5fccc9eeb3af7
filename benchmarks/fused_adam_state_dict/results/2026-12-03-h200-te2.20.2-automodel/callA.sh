#!/usr/bin/env bash
# Call A (2026-12-03): where DefaultStager's staging goes (stage_parts.py), what pinning a
# resume's template costs (template_pin.py), then the checkpoint stall in NeMo Automodel's
# configuration (FSDP2, 2^29 BF16 elements, store_param_remainders, BF16 moments; DefaultStager()
# with torch's StagingOptions, a new one per checkpoint) with the PROCESS and the thread
# checkpointer, TE's default export and the option side by side, 1 first + 3 steady checkpoints.
# Run from the repository root on the device (te-kit wheel carried in .te-kit).
set -u; R=$PWD; L=$OUT; H=benchmarks/fused_adam_state_dict/results/2026-12-03-h200-te2.20.2-automodel
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $L/summary.txt; }
bash .te-kit/install.sh .te-kit /tmp/te-site > $L/install.log 2>&1 || { tail -30 $L/install.log; exit 1; }
(cd /tmp/te-site && git apply --include='transformer_engine/*' $R/patches/1-export/000[1-4]-*.patch $R/patches/2-upstream-3507/0001-*.patch) && t "stack applied"
export PYTHONPATH=/tmp/te-site:$R; nproc | tee -a $L/summary.txt; df -h /tmp /dev/shm | tee -a $L/summary.txt
timeout 100 python3 $H/stage_parts.py --threads 16 --repeats 2 > $L/stage_parts.jsonl 2> $L/stage_parts.err; t "stage_parts 16 rc=$?"
timeout 50 python3 $H/stage_parts.py --threads 1 --repeats 1 >> $L/stage_parts.jsonl 2>> $L/stage_parts.err; t "stage_parts 1 rc=$?"
timeout 45 python3 $H/template_pin.py > $L/template_pin.jsonl 2> $L/template_pin.err; t "template_pin rc=$?"
PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,pinned_num_register_threads:16 timeout 45 python3 $H/template_pin.py >> $L/template_pin.jsonl 2>> $L/template_pin.err; t "template_pin register rc=$?"
cd benchmarks/fused_adam_state_dict
S="torchrun --standalone --nproc_per_node=1 benchmark_checkpoint_stall.py --local-log2 29 --iterations short --checkpoints 4 --store-param-remainders --default-stager-options automodel --out $L/automodel.jsonl"
timeout 170 $S --checkpointer process --modes default offload --variants default_stager > $L/process.log 2>&1; t "process rc=$?"
timeout 150 $S --checkpointer thread --modes default offload --variants none default_stager > $L/thread.log 2>&1; t "thread rc=$?"
tail -4 $L/*.log $L/*.err
