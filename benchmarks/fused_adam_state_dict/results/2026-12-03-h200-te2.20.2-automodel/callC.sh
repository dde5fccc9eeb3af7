#!/usr/bin/env bash
# Call C (2026-12-03): first TE's single-GPU optimizer tests on the stack with PR 2's test too
# (call B's stack tree lacked it). Then, quiet, one after the other, checkpoints written to
# /dev/shm (uploads in seconds, not call A's 13-22 s to disk): in NeMo Automodel's configuration
# (FSDP2, 2^29 BF16 elements, store_param_remainders, BF16 moments) the option under
# CheckpointStager (prepared, asynchronous staging, thread checkpointer), and under a new
# DefaultStager per checkpoint with the PROCESS checkpointer and StagingOptions without pinned
# memory (unpinned) and without pinned or shared memory (plain); 1 first + 3 steady. Last, the
# resume (benchmark_resume.py, FP32 master weights) with PyTorch's host-register pinning.
set -u; R=$PWD; L=$OUT; export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $L/summary.txt; }
bash .te-kit/install.sh .te-kit /tmp/te-site > $L/install.log 2>&1 || { tail -30 $L/install.log; exit 1; }
(cd /tmp/te-site && git apply --include='transformer_engine/*' $R/patches/1-export/000[1-4]-*.patch $R/patches/2-upstream-3507/0001-*.patch) && t "stack applied"
mkdir -p /tmp/single; (cd /tmp/single && PYTHONPATH=/tmp/te-site timeout -k 10 90 python3 -m pytest -p no:cacheprovider -rs --tb=short $R/.devrun/trees/stack/tests/pytorch/test_fused_optimizer.py > $L/single_stack.log 2>&1); t "single stack rc=$?: $(tail -1 $L/single_stack.log)"
export PYTHONPATH=/tmp/te-site:$R; cd benchmarks/fused_adam_state_dict
S="torchrun --standalone --nproc_per_node=1 benchmark_checkpoint_stall.py --local-log2 29 --iterations short --checkpoints 4 --store-param-remainders --modes offload --ckpt-dir /dev/shm/te_stall --out $L/automodel.jsonl"
timeout 110 $S --checkpointer thread --variants te_stager_async --prepare > $L/te.log 2>&1; t "te rc=$?"
for o in unpinned plain; do timeout 120 $S --checkpointer process --default-stager-options $o --variants default_stager > $L/process_$o.log 2>&1; t "process $o rc=$?"; done
rm -rf /dev/shm/te_stall
PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,pinned_num_register_threads:16 timeout 120 torchrun --standalone --nproc_per_node=1 benchmark_resume.py --local-log2 29 --repeats 2 --out $L/resume.jsonl > $L/resume.log 2>&1; t "resume register rc=$?"
tail -3 $L/*.log
