# Copyright (c) 2022-2026, NVIDIA CORPORATION & AFFILIATES. All rights reserved.
#
# See LICENSE for license information.

"""A checkpoint as users take it: FSDP2 + torch.distributed.checkpoint, default FusedAdam
against FusedAdam(state_dict_cpu_offload=True).

  torchrun --nproc_per_node=2 benchmark_dcp_checkpoint.py --local-log2 29 --out dcp.jsonl

Per rank: 2^local-log2 BF16 parameter elements (square bias-free Linear layers of
2^largest-log2 elements each, sharded with fully_shard), FP32 master weights, BF16 moments.
For each mode (default, offload) it builds the model and optimizer, trains --steps steps and
measures, as the slowest rank sees it (seconds; GPU peaks above what was allocated before):
  export          get_optimizer_state_dict(cpu_offload=True), and get_model_state_dict
  save            dcp.save({"model", "optim"}) of that export
  async_save      dcp.async_save with torch's default stager: until it returns (training is
                  blocked) and until the upload completes
  async_staged    dcp.async_save with DefaultStager(StagingOptions(use_async_staging=True,
                  ...)): until it returns, until staging completes, until the upload completes
  resume          a template state dict, dcp.load, set_optimizer_state_dict into an optimizer
                  that holds state; the loaded states are compared bitwise with the saved ones
Each step's row also gives the time of the export inside it. One JSON line per mode and
step (rank 0); plot_results.py draws them (dcp_checkpoint.png).

--oom-demo caps this process's GPU memory (torch.cuda.set_per_process_memory_fraction) at
the training peak plus --margin-gib, so that training fits: then the default export and load
run out of memory, and with the option the same optimizer saves and resumes.
"""

import argparse
import json
import os
import shutil
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # PyTorch < 2.6
    from torch.distributed._composable.fsdp import fully_shard

import transformer_engine
import transformer_engine.pytorch as te

GiB = 1024**3
OPTIONS = StateDictOptions(cpu_offload=True)


def _max_over_ranks(value):
    t = torch.tensor([float(value)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


@contextmanager
def _measure(row, name, gpu=True):
    """Seconds (slowest rank) and GPU peak of the block, into row[name + '_s' / '_gpu_gib']."""
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    yield
    torch.cuda.synchronize()
    row[name + "_s"] = round(_max_over_ranks(time.perf_counter() - start), 3)
    if gpu:
        peak = torch.cuda.max_memory_allocated() - before
        row[name + "_gpu_gib"] = round(_max_over_ranks(peak) / GiB, 3)


def _build(args, offload):
    torch.manual_seed(1234)
    width = 2 ** (args.largest_log2 // 2)
    layers = 2**args.local_log2 * dist.get_world_size() // (width * width)
    model = torch.nn.Sequential(
        *[torch.nn.Linear(width, width, bias=False) for _ in range(layers)]
    ).to(device="cuda", dtype=torch.bfloat16)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = te.optimizers.FusedAdam(
        model.parameters(),
        lr=1e-4,
        master_weights=True,
        exp_avg_dtype=torch.bfloat16,
        exp_avg_sq_dtype=torch.bfloat16,
        # The master weights as int16 remainders of the BF16 parameters, where a caller's
        # arguments ask for them (benchmark_checkpoint_stall.py's --store-param-remainders)
        store_param_remainders=getattr(args, "store_param_remainders", False),
        state_dict_cpu_offload=offload,
    )
    return model, optimizer, width


def _train(model, optimizer, width, steps):
    x = torch.randn(8, width, device="cuda", dtype=torch.bfloat16)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        model(x).float().square().mean().backward()
        optimizer.step()
    torch.cuda.synchronize()


def _export(model, optimizer, row, model_options=OPTIONS):
    with _measure(row, "export_optim"):
        optim = get_optimizer_state_dict(model, optimizer, options=OPTIONS)
    with _measure(row, "export_model"):
        model_sd = get_model_state_dict(model, options=model_options)
    return {"model": model_sd, "optim": optim}


def _local_states(optimizer):
    """CPU copies of the optimizer's states as its export gives them (FP32), for comparing."""
    offload = optimizer.state_dict_cpu_offload
    optimizer.state_dict_cpu_offload = True
    try:
        out = {}
        for key, state in optimizer.state_dict()["state"].items():
            for name, value in state.items():
                local = value._local_tensor if isinstance(value, DTensor) else value
                out[(key, name)] = local.cpu()
        return out
    finally:
        optimizer.state_dict_cpu_offload = offload


def _equal_on_all_ranks(saved, loaded):
    """Whether every rank's states (of _local_states) are bitwise equal."""
    differ = saved.keys() != loaded.keys() or any(
        not torch.equal(v, loaded[k]) for k, v in saved.items()
    )
    return _max_over_ranks(differ) == 0


def _resume(model, optimizer, path, row):
    with _measure(row, "resume"):
        state = {
            "model": get_model_state_dict(model, options=OPTIONS),
            "optim": get_optimizer_state_dict(model, optimizer, options=OPTIONS),
        }
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state["model"], options=OPTIONS)
        set_optimizer_state_dict(model, optimizer, state["optim"], options=OPTIONS)


def _emit(args, row):
    if dist.get_rank() == 0:
        line = json.dumps(row)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a", encoding="utf-8") as f:
                f.write(line + "\n")


def _checkpoint_dir(args, name):
    path = os.path.join(args.ckpt_dir, name)
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()
    return path


def _remove(path):
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


def run_mode(args, base, mode):
    """Export, save, async_save (three ways) and resume, for one mode."""
    model, optimizer, width = _build(args, mode == "offload")
    _train(model, optimizer, width, args.steps)
    saved = _local_states(optimizer)
    path = _checkpoint_dir(args, f"{mode}-save")
    # async_save runs its collectives in a thread: give it a group of its own, so that they
    # never interleave with this thread's (as torch's docs advise).
    async_group = dist.new_group(backend="gloo")

    if "save" in args.checkpoints:
        row = dict(base, mode=mode, step="save")
        state = _export(model, optimizer, row)
        with _measure(row, "save"):
            dcp.save(state, checkpoint_id=path)
        _emit(args, row)
        del state
    if "async_save" in args.checkpoints:
        _async_save(args, base, mode, model, optimizer, async_group)
    for step in ("async_staged", "async_staged_gpu_model"):
        if step in args.checkpoints:
            _async_staged(args, base, mode, model, optimizer, async_group, step)
    if "save" in args.checkpoints and "resume" in args.checkpoints:
        _resume_new(args, base, mode, path, saved)
    _remove(path)


def _async_save(args, base, mode, model, optimizer, async_group):
    """dcp.async_save with torch's default stager."""
    row = dict(base, mode=mode, step="async_save")
    with _measure(row, "blocked", gpu=False):
        state = _export(model, optimizer, row)
        future = dcp.async_save(
            state,
            checkpoint_id=_checkpoint_dir(args, f"{mode}-async"),
            process_group=async_group,
        )
    with _measure(row, "until_uploaded", gpu=False):
        future.result()
    _emit(args, row)
    del state, future
    _remove(os.path.join(args.ckpt_dir, f"{mode}-async"))


def _async_staged(args, base, mode, model, optimizer, async_group, step):
    """dcp.async_save with DefaultStager's asynchronous staging; the model state on CPU, or
    (async_staged_gpu_model) left on GPU for the stager to copy."""
    from torch.distributed.checkpoint.staging import (  # pylint: disable=import-outside-toplevel
        DefaultStager,
        StagingOptions,
    )

    row = dict(base, mode=mode, step=step)
    model_options = StateDictOptions() if step == "async_staged_gpu_model" else OPTIONS
    stager = DefaultStager(
        StagingOptions(
            use_pinned_memory=True,
            use_shared_memory=False,
            use_async_staging=True,
            use_non_blocking_copy=True,
        )
    )
    with _measure(row, "blocked", gpu=False):
        state = _export(model, optimizer, row, model_options)
        response = dcp.async_save(
            state,
            checkpoint_id=_checkpoint_dir(args, f"{mode}-staged"),
            process_group=async_group,
            async_stager=stager,
        )
    with _measure(row, "until_staged", gpu=False):
        response.staging_completion.result()
    with _measure(row, "until_uploaded", gpu=False):
        response.upload_completion.result()
    stager.close()
    _emit(args, row)
    del state, response
    _remove(os.path.join(args.ckpt_dir, f"{mode}-staged"))


def _resume_new(args, base, mode, path, saved):
    """Resume into a new model and optimizer that holds the state of one step."""
    torch.cuda.empty_cache()
    model, optimizer, width = _build(args, mode == "offload")
    _train(model, optimizer, width, 1)
    row = dict(base, mode=mode, step="resume")
    _resume(model, optimizer, path, row)
    row["bitwise_equal"] = _equal_on_all_ranks(saved, _local_states(optimizer))
    _emit(args, row)


def oom_demo(args, base):
    """Training fits under the cap; the default checkpoint does not; the option does."""
    model, optimizer, width = _build(args, offload=False)
    _train(model, optimizer, width, args.steps)
    torch.cuda.empty_cache()
    training_peak = torch.cuda.max_memory_allocated()
    total = torch.cuda.get_device_properties(0).total_memory
    cap = training_peak + int(args.margin_gib * GiB)
    torch.cuda.set_per_process_memory_fraction(cap / total)
    _train(model, optimizer, width, 1)  # training still fits
    row = dict(
        base,
        mode="oom_demo",
        training_peak_gib=round(training_peak / GiB, 3),
        cap_gib=round(cap / GiB, 3),
    )
    path = _checkpoint_dir(args, "oom-demo")
    for offload in (False, True):
        name = "offload" if offload else "default"
        optimizer.state_dict_cpu_offload = offload
        try:
            state = _export(model, optimizer, {})
            dcp.save(state, checkpoint_id=path)
            row[name + "_save"] = "ok"
        except torch.cuda.OutOfMemoryError as exc:
            row[name + "_save"] = "CUDA OOM: " + str(exc).split(".", maxsplit=1)[0]
            state = None
        torch.cuda.empty_cache()
        if state is None:
            continue
        saved = _local_states(optimizer)
        _train(model, optimizer, width, 1)  # move on, then resume the checkpoint
        for load_offload in (False, True):
            optimizer.state_dict_cpu_offload = load_offload
            try:
                _resume(model, optimizer, path, {})
                same = _equal_on_all_ranks(saved, _local_states(optimizer))
                row["resume_" + ("offload" if load_offload else "default")] = (
                    "ok, bitwise equal" if same else "ok, NOT equal"
                )
            except torch.cuda.OutOfMemoryError as exc:
                row["resume_" + ("offload" if load_offload else "default")] = (
                    "CUDA OOM: " + str(exc).split(".", maxsplit=1)[0]
                )
            torch.cuda.empty_cache()
    _train(model, optimizer, width, 1)  # and training goes on
    row["training_after"] = "ok"
    _emit(args, row)
    _remove(path)


def main():
    """Parse arguments, run the modes under torchrun, write the rows."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    parser.add_argument("--local-log2", type=int, default=29, help="parameter elements per rank")
    parser.add_argument("--largest-log2", type=int, default=24, help="elements per layer (even)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--modes", nargs="+", default=["default", "offload"])
    parser.add_argument(
        "--checkpoints",
        nargs="+",
        default=["save", "async_save", "async_staged", "async_staged_gpu_model", "resume"],
    )
    parser.add_argument("--ckpt-dir", default="/tmp/te_dcp_checkpoint_benchmark")
    parser.add_argument("--out", help="append the JSON lines to this file")
    parser.add_argument("--oom-demo", action="store_true")
    parser.add_argument("--margin-gib", type=float, default=1.0)
    args = parser.parse_args()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend="cpu:gloo,cuda:nccl")
    base = {
        "world_size": dist.get_world_size(),
        "local_log2": args.local_log2,
        "largest_log2": args.largest_log2,
        "gpu": torch.cuda.get_device_name(),
        "cpus": os.cpu_count(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "torch": torch.__version__,
        "te": transformer_engine.__version__,
    }
    try:
        if args.oom_demo:
            oom_demo(args, base)
        else:
            for mode in args.modes:
                run_mode(args, base, mode)
                torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
