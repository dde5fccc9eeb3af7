"""A TE review's smaller design for PR 1, measured: each state copied to a new CPU FP32 tensor
with one copy_() (PyTorch converts a GPU -> CPU copy of another dtype on the CPU, through a
pageable temporary of the source's dtype; no GPU memory), against today's export path
(.float() on the GPU, then .cpu()). 64 states of 2^24 elements (2^30 elements), BF16 and FP32
(the master weights), 16 intra-op threads; GB/s of the FP32 bytes made, twice each.

  python3 direct_copy.py
"""

import json
import time

import torch

N, ELEMENTS = 64, 1 << 24


def _timed(function):
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = function()
    torch.cuda.synchronize()
    return result, time.perf_counter() - start


def main():
    torch.empty(1, device="cuda")
    for dtype in (torch.bfloat16, torch.float32):
        states = [torch.randn(ELEMENTS, device="cuda").to(dtype) for _ in range(N)]
        nbytes = N * ELEMENTS * 4
        kept = {}
        for name, export in (
            ("today", lambda s: s.float().cpu()),
            ("direct_copy", lambda s: torch.empty(s.shape, dtype=torch.float32).copy_(s)),
        ):
            for repeat in range(2):
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
                out, seconds = _timed(lambda: [export(s) for s in states])
                peak = torch.cuda.max_memory_allocated() - before
                row = dict(dtype=str(dtype), way=name, repeat=repeat, seconds=round(seconds, 3))
                row.update(GBps=round(nbytes / seconds / 1e9, 2), gpu_peak_mib=peak >> 20)
                print(json.dumps(row), flush=True)
                kept[name] = out
                del out
        same = all(torch.equal(a, b) for a, b in zip(kept["today"], kept["direct_copy"]))
        print(json.dumps(dict(dtype=str(dtype), bitwise=same)), flush=True)
        del states, kept


if __name__ == "__main__":
    main()
