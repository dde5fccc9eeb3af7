"""The least a DefaultStager checkpoint of the option's export can stall, measured.

  python3 stager_floor.py [--threads 16 1] [--repeats 3]

NeMo Automodel's configuration at 2^29 parameter elements (one process, one GPU): 32 BF16
parameters of 2^24 elements, TE's FusedAdam with master_weights, store_param_remainders, BF16
moments and state_dict_cpu_offload=True, after one step. A DefaultStager checkpoint stalls
training for the export (optimizer.state_dict()) and then the staging, which training waits for
before its next step. The best case of DCP's stager is a stager kept for the run whose cache
hits: torch >= 2.13 keeps a DefaultStager's cache, keyed by the source tensors' storages, so it
would hit if the export wrote into the same CPU memory at every checkpoint (PR 1 does not: that
would keep one more copy of the state on the host). Then the staging is only copies into
pinned shared memory already written: the CPU tensors' copy and the parameters' D2H.

Per thread count (torch.set_num_threads; torchrun sets OMP_NUM_THREADS=1 with several
processes per host): the export's seconds; the staging of one state dict (the parameters and
the first export) by one StateDictStager(pin_memory=True, share_memory=True), as
DefaultStager() makes it: first (allocating), then again (its cache hits), each synchronized
as DefaultStager's staging is; the floor = the export + a hit. torch 2.11's DefaultStager
closes its StateDictStager after each staging (a kept one raises at its second), so the
StateDictStager is called directly, as torch 2.13's DefaultStager calls it. One JSON line each.
"""

import argparse
import json
import time

import torch
from torch.distributed.checkpoint._state_dict_stager import StateDictStager
from transformer_engine.pytorch.optimizers import FusedAdam

LAYERS, ELEMENTS = 32, 1 << 24


def _tensors(tree):
    if torch.is_tensor(tree):
        return [tree]
    if isinstance(tree, dict):
        return [t for key in sorted(tree, key=str) for t in _tensors(tree[key])]
    if isinstance(tree, (list, tuple)):
        return [t for value in tree for t in _tensors(value)]
    return []


def _timed(function):
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = function()
    torch.cuda.synchronize()
    return result, time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, nargs="+", default=[16, 1])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    params = [
        torch.nn.Parameter(torch.randn(ELEMENTS, dtype=torch.bfloat16, device="cuda"))
        for _ in range(LAYERS)
    ]
    optimizer = FusedAdam(
        params,
        lr=1e-4,
        master_weights=True,
        store_param_remainders=True,
        exp_avg_dtype=torch.bfloat16,
        exp_avg_sq_dtype=torch.bfloat16,
        state_dict_cpu_offload=True,
    )
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer.step()
    model = {f"{i}.weight": param.detach() for i, param in enumerate(params)}
    for threads in args.threads:
        torch.set_num_threads(threads)
        exports = []
        for _ in range(args.repeats):
            exported, seconds = _timed(optimizer.state_dict)
            exports.append(round(seconds, 3))
        state_dict = {"model": model, "optim": exported}
        sources = _tensors(state_dict)
        stager = StateDictStager(pin_memory=True, share_memory=True)
        stage = lambda: stager.stage(state_dict, non_blocking=True)
        staged, first = _timed(stage)
        hits, same = [], True
        for _ in range(args.repeats):
            again, seconds = _timed(stage)
            hits.append(round(seconds, 3))
            same &= all(
                a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                for a, b in zip(_tensors(again), _tensors(staged))
            )
        copies = _tensors(again)
        equal = len(copies) == len(sources) and all(
            not c.is_cuda and c.dtype == s.dtype and torch.equal(c, s.cpu())
            for c, s in zip(copies, sources)
        )
        row = dict(
            threads=threads,
            state_dict_gb=round(sum(t.nbytes for t in sources) / 1e9, 2),
            export_on_gpu=sum(t.is_cuda for t in _tensors(exported)),
            export_s=exports,
            stage_first_s=round(first, 3),
            stage_hit_s=hits,
            cache_hit=same,
            staged_equal=equal,
            floor_s=round(min(exports) + min(hits), 3),
        )
        print(json.dumps(row), flush=True)
        stager.close()
        del staged, again, exported, state_dict


if __name__ == "__main__":
    main()
