# Copyright (c) 2022-2026, NVIDIA CORPORATION & AFFILIATES. All rights reserved.
#
# See LICENSE for license information.

"""The GPU peak of DCP's standard resume, end to end, in a new process: TE's load (with #3507)
against load_state_dict_in_place=True, for one optimizer configuration per process.

  torchrun --nproc_per_node=1 whole_resume.py --phase save --config bf16 --ckpt /dev/shm/r
  torchrun --nproc_per_node=1 whole_resume.py --phase resume --config bf16 --load te ...

FSDP2 (fully_shard per layer) of BF16 nn.Linear weights, 2^local-log2 elements per rank in
layers of 2^24 (4096 x 4096), FusedAdam(master_weights=True, state_dict_cpu_offload=True) of
the configuration:
  bf16         FP32 master weights, BF16 moments
  fp16         FP32 master weights, FP16 moments
  fp8          FP32 master weights, FP8 moments
  fp16_master  FP16 master weights, BF16 moments
save: one step from random gradients, then dcp.save of the model and the optimizer
(get_*_state_dict, cpu_offload=True). resume (a new process): the resume users run, each phase
timed and its GPU peak taken (torch.cuda.max_memory_allocated, reset before the phase, above
what was allocated when the process had built its model and optimizer):
  template  get_model_state_dict + get_optimizer_state_dict (DCP's _init_optim_state makes the
            states with a step of zero gradients; the option exports them to CPU)
  load      dcp.load into the template
  set       set_model_state_dict + set_optimizer_state_dict (TE's load, or the in-place one)
  step      gradients made (randn, as a backward would) and the first optimizer.step()
peak_gib: the largest of the four. One JSON line per resume.
"""

import argparse
import json
import os
import time

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
from torch.distributed.fsdp import fully_shard

import transformer_engine
import transformer_engine.pytorch as te

CONFIGS = {
    "bf16": (torch.float32, torch.bfloat16),
    "fp16": (torch.float32, torch.float16),
    "fp8": (torch.float32, torch.uint8),
    "fp16_master": (torch.float16, torch.bfloat16),
}
OPTIONS = StateDictOptions(cpu_offload=True)
GIB = 1024**3


def build(args, in_place):
    torch.manual_seed(0)
    layers = [
        torch.nn.Linear(4096, 4096, bias=False, device="cuda", dtype=torch.bfloat16)
        for _ in range(2 ** (args.local_log2 - 24) * dist.get_world_size())
    ]
    model = torch.nn.Sequential(*layers)
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    master, moments = CONFIGS[args.config]
    kwargs = {"load_state_dict_in_place": True} if in_place else {}
    optimizer = te.optimizers.FusedAdam(
        model.parameters(),
        lr=1e-4,
        master_weights=True,
        master_weight_dtype=master,
        exp_avg_dtype=moments,
        exp_avg_sq_dtype=moments,
        state_dict_cpu_offload=True,
        **kwargs,
    )
    return model, optimizer


def grads(model):
    for p in model.parameters():
        p.grad = torch.empty_like(p)
        p.grad._local_tensor.normal_()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=["save", "resume"], required=True)
    parser.add_argument("--config", choices=list(CONFIGS), required=True)
    parser.add_argument("--load", choices=["te", "in_place"], default="te")
    parser.add_argument("--local-log2", type=int, default=29)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend="cpu:gloo,cuda:nccl")
    path = f"{args.ckpt}/{args.config}"
    try:
        model, optimizer = build(args, args.load == "in_place")
        if args.phase == "save":
            grads(model)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            state = {
                "model": get_model_state_dict(model, options=OPTIONS),
                "optim": get_optimizer_state_dict(model, optimizer, options=OPTIONS),
            }
            dcp.save(state, checkpoint_id=path)
            return
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        row = {"config": args.config, "load": args.load, "local_log2": args.local_log2}
        template = {}

        def phase(name, fn):
            torch.cuda.synchronize()
            dist.barrier()
            torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            row[f"{name}_s"] = round(time.perf_counter() - start, 3)
            row[f"{name}_peak_gib"] = round((torch.cuda.max_memory_allocated() - base) / GIB, 3)

        def make_template():
            template["model"] = get_model_state_dict(model, options=OPTIONS)
            template["optim"] = get_optimizer_state_dict(model, optimizer, options=OPTIONS)

        def load():
            dcp.load(template, checkpoint_id=path)

        def set_states():
            set_model_state_dict(model, template["model"], options=OPTIONS)
            set_optimizer_state_dict(model, optimizer, template["optim"], options=OPTIONS)

        def step():
            template.clear()
            grads(model)
            optimizer.step()

        phase("template", make_template)
        phase("load", load)
        phase("set", set_states)
        phase("step", step)
        row["peak_gib"] = max(row[f"{p}_peak_gib"] for p in ("template", "load", "set", "step"))
        row["states_gib"] = round((torch.cuda.memory_allocated() - base) / GIB, 3)
        row.update(torch=torch.__version__, te=transformer_engine.__version__)
        if dist.get_rank() == 0:
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a", encoding="utf-8") as f:
                    f.write(json.dumps(row) + "\n")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
