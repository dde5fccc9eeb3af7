#!/usr/bin/env bash
# Call D (2026-12-03): side by side in one run, checkpoints written to /dev/shm as in call C: the
# option under a new DefaultStager per checkpoint with the PROCESS checkpointer, torch's
# StagingOptions (as DefaultStager() in NeMo Automodel) and without pinned or shared memory
# (plain); then the resume (benchmark_resume.py) with PyTorch's default pinned allocation and
# with its host-register pinning.
set -u; R=$PWD; L=$OUT; export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $L/summary.txt; }
bash .te-kit/install.sh .te-kit /tmp/te-site > $L/install.log 2>&1 || { tail -30 $L/install.log; exit 1; }
(cd /tmp/te-site && git apply --include='transformer_engine/*' $R/patches/1-export/000[1-4]-*.patch $R/patches/2-upstream-3507/0001-*.patch) && t "stack applied"
export PYTHONPATH=/tmp/te-site:$R; cd benchmarks/fused_adam_state_dict
S="torchrun --standalone --nproc_per_node=1 benchmark_checkpoint_stall.py --local-log2 29 --iterations short --checkpoints 4 --store-param-remainders --modes offload --ckpt-dir /dev/shm/te_stall --out $L/automodel.jsonl"
for o in automodel plain; do timeout 100 $S --checkpointer process --default-stager-options $o --variants default_stager > $L/process_$o.log 2>&1; t "process $o rc=$?"; done
rm -rf /dev/shm/te_stall
timeout 100 torchrun --standalone --nproc_per_node=1 benchmark_resume.py --local-log2 29 --repeats 2 --out $L/resume.jsonl > $L/resume_default.log 2>&1; t "resume default rc=$?"
PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,pinned_num_register_threads:16 timeout 100 torchrun --standalone --nproc_per_node=1 benchmark_resume.py --local-log2 29 --repeats 2 --out $L/resume.jsonl > $L/resume_register.log 2>&1; t "resume register rc=$?"
