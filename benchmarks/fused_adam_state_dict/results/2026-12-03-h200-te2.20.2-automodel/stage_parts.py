"""Where DefaultStager's staging of NeMo Automodel's state dict goes, one part at a time.

  python3 stage_parts.py [--threads 16 1]

The state dict of one rank at 2^29 parameter elements (FusedAdam with store_param_remainders,
BF16 moments, state_dict_cpu_offload=True): 32 layers, each a BF16 parameter of 2^24 elements on
the GPU and, from the option's export, its int16 remainders and FP32 exp_avg, exp_avg_sq on the
CPU (6 GiB). Staged synchronously (as DefaultStager's staging thread does it), a new stager each
time, with torch's StagingOptions as DefaultStager() has them and without pinning or shared
memory; then the parts of its CPU tensors' staging alone: the shared-memory allocation, the
pinning (cudaHostRegister, torch.cuda._pin_memory_utils), the copy, in DCP's order and with the
copy before the pinning. One JSON line each.
"""

import argparse
import json
import time

import torch
import torch.cuda._pin_memory_utils as pin_utils
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

LAYERS, ELEMENTS = 32, 1 << 24


def _state_dict():
    cpu = {}
    for i in range(LAYERS):
        cpu[f"{i}.master_param"] = torch.ones(ELEMENTS, dtype=torch.int16)
        cpu[f"{i}.exp_avg"] = torch.ones(ELEMENTS)
        cpu[f"{i}.exp_avg_sq"] = torch.ones(ELEMENTS)
    model = {
        f"{i}.weight": torch.ones(ELEMENTS, dtype=torch.bfloat16, device="cuda")
        for i in range(LAYERS)
    }
    return model, cpu


def _timed(function):
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = function()
    torch.cuda.synchronize()
    return result, round(time.perf_counter() - start, 3)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, nargs="+", default=[16, 1])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    model, cpu = _state_dict()
    gib = sum(t.nbytes for t in (*model.values(), *cpu.values())) / 2**30
    options = {
        "automodel": StagingOptions(),
        "unpinned": StagingOptions(use_pinned_memory=False),
        "unshared": StagingOptions(use_shared_memory=False),
        "neither": StagingOptions(use_pinned_memory=False, use_shared_memory=False),
    }
    for threads in args.threads:
        torch.set_num_threads(threads)
        for repeat in range(args.repeats):
            for name, option in options.items():
                option.use_async_staging = False
                for part, state in (("all", {**model, **cpu}), ("cpu", cpu)):
                    stager = DefaultStager(option)
                    staged, seconds = _timed(lambda: stager.stage(state))
                    stager.close()
                    del staged
                    row = dict(
                        what="DefaultStager",
                        options=name,
                        part=part,
                        threads=threads,
                        repeat=repeat,
                        gib=round(gib if part == "all" else gib - 1, 2),
                        s=seconds,
                    )
                    print(json.dumps(row), flush=True)
            # The CPU tensors' staging by parts (DCP's order: allocate, pin, copy; then copy first).
            for order in ("pin_then_copy", "copy_then_pin"):
                row = dict(what="parts", order=order, threads=threads, repeat=repeat)
                storages, row["alloc_s"] = _timed(
                    lambda: [
                        torch.UntypedStorage._new_shared(t.nbytes, device="cpu")
                        for t in cpu.values()
                    ]
                )
                pin = lambda: [pin_utils.pin_memory(s.data_ptr(), s.nbytes()) for s in storages]
                copy = lambda: [
                    s.copy_(t.untyped_storage()) for s, t in zip(storages, cpu.values())
                ]
                for step, function in (
                    (("pin", pin), ("copy", copy))
                    if order == "pin_then_copy"
                    else (("copy", copy), ("pin", pin))
                ):
                    _, row[f"{step}_s"] = _timed(function)
                _, row["unpin_s"] = _timed(
                    lambda: [pin_utils.unpin_memory(s.data_ptr()) for s in storages]
                )
                _, row["free_s"] = _timed(lambda: storages.clear())
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
