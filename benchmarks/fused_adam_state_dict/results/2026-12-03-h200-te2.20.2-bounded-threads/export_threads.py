# Copyright (c) 2022-2026, NVIDIA CORPORATION & AFFILIATES. All rights reserved.
#
# See LICENSE for license information.

"""How the CPU threads of FusedAdam(state_dict_cpu_offload=True)'s export copy out of the pinned
ring, without changing PyTorch's intra-op threads for other threads: the designs side by side,
in one process (or in each of several processes at once, under torchrun), on the same states.

  python export_threads.py --out rows.jsonl                          # one process, 2^30
  torchrun --nproc_per_node=8 export_threads.py --out rows.jsonl     # 8 at once, 2^27 each

Designs (each replaces fused_adam._CopyToCPU for its exports; the export code around it is the
installed TE's):
  default     state_dict() without the option, then .cpu() of every tensor (DCP's cpu_offload)
  num_threads the pool's threads call torch.set_num_threads(1) first, the setting put back at the
              end (PR 1 as reviewed: PyTorch's default for threads started later changes)
  plain       the pool's threads copy each piece with one copy_(), intra-op settings untouched
  chunked     the pool's threads copy each piece in parts of 32768 elements, below PyTorch's
              grain size for intra-op parallelism, so each part runs on the thread that copies
              it whatever the intra-op setting; intra-op settings untouched
Rows: design, moments, procs, round (0 = the first export of that design in the process),
seconds (slowest process), GBps (the FP32/int16 bytes of all processes / seconds), intra_op
(torch.get_num_threads() of the process), omp (OMP_NUM_THREADS), threads (the pool's), rule
(true: TE's own count of threads; false: --pool, which replaces it; --intra-op N calls
torch.set_num_threads(N) first).
Each export is compared with the first design's, bitwise, on every state (same).
"""

import argparse
from collections import deque
from concurrent.futures import ThreadPoolExecutor
import gc
import json
import os
import time

import torch
import torch.distributed as dist

import transformer_engine
import transformer_engine.pytorch as te
from transformer_engine.pytorch.optimizers import fused_adam

MOMENTS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.uint8}
BUFFER = 16 * 1024 * 1024
GRAIN = 32768


class Ring:
    """The pinned ring of PR 1 (_CopyToCPU), with the threads' copy of each design."""

    def __init__(self, threads, initializer=None, chunked=False):
        init = (torch.set_num_threads, (1,)) if initializer else (None, ())
        self._intra_op = torch.get_num_threads()
        self._initializer = initializer
        self._pool = ThreadPoolExecutor(threads, "ExportThreads", *init) if threads else None
        self._buffers = [None] * (threads + 2 if threads else 1)
        self._pending = deque()
        self._count = 0
        self._pieces = []
        self._used = 0
        self._device = None
        self._chunked = chunked

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        try:
            if exc_type is None:
                self._submit()
                for future in self._pending:
                    future.result()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)
            if self._initializer:
                torch.set_num_threads(self._intra_op)

    def copy(self, src, dst):
        nbytes = src.numel() * src.element_size()
        if self._pieces and (self._used + nbytes > BUFFER or src.device != self._device):
            self._submit()
        index = self._count % len(self._buffers)
        if not self._pieces:
            if len(self._pending) == len(self._buffers):
                self._pending.popleft().result()
            if self._buffers[index] is None:
                self._buffers[index] = torch.empty(BUFFER, dtype=torch.uint8, pin_memory=True)
            self._used, self._device = 0, src.device
        staged = self._buffers[index][self._used : self._used + nbytes].view(src.dtype)
        self._used += -(-nbytes // 16) * 16
        staged.copy_(src, non_blocking=True)
        self._pieces.append((staged, dst))

    def _submit(self):
        if self._pieces:
            torch.cuda.current_stream(self._device).synchronize()
            copy_out = self._copy_chunked if self._chunked else self._copy_plain
            if self._pool is None:
                copy_out(self._pieces)
            else:
                self._pending.append(self._pool.submit(copy_out, self._pieces))
            self._count += 1
            self._pieces = []

    @staticmethod
    def _copy_plain(pieces):
        for staged, dst in pieces:
            dst.copy_(staged)

    @staticmethod
    def _copy_chunked(pieces):
        for staged, dst in pieces:
            for start in range(0, staged.numel(), GRAIN):
                dst[start : start + GRAIN].copy_(staged[start : start + GRAIN])


DESIGNS = {
    "num_threads": lambda threads: Ring(threads, initializer=True),
    "plain": lambda threads: Ring(threads),
    "chunked": lambda threads: Ring(threads, chunked=True),
}


def build(elements, moments):
    """BF16 parameters of 2^24 elements (4096 x 4096) and a FusedAdam that took one step."""
    params = [
        torch.nn.Parameter(torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16))
        for _ in range(elements // 2**24)
    ]
    opt = te.optimizers.FusedAdam(
        params,
        lr=1e-3,
        master_weights=True,
        exp_avg_dtype=MOMENTS[moments],
        exp_avg_sq_dtype=MOMENTS[moments],
        state_dict_cpu_offload=True,
    )
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    for p in params:
        p.grad = None
    return opt


def export(opt, design):
    if design == "default":
        opt.state_dict_cpu_offload = False
        try:
            sd = opt.state_dict()
            return {
                "state": {k: {n: v.cpu() for n, v in s.items()} for k, s in sd["state"].items()}
            }
        finally:
            opt.state_dict_cpu_offload = True
    if design == "te":  # the installed TE's own _CopyToCPU
        return opt.state_dict()
    original = fused_adam._CopyToCPU
    fused_adam._CopyToCPU = DESIGNS[design]
    try:
        return opt.state_dict()
    finally:
        fused_adam._CopyToCPU = original


def nbytes(sd):
    return sum(v.numel() * v.element_size() for s in sd["state"].values() for v in s.values())


def same(a, b):
    return all(
        torch.equal(a["state"][k][n], v) for k, s in b["state"].items() for n, v in s.items()
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--total-log2", type=int, default=30, help="elements of all processes")
    parser.add_argument("--moments", nargs="+", default=["bf16", "fp16", "fp8"])
    parser.add_argument(
        "--designs", nargs="+", default=["default", "num_threads", "plain", "chunked"]
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--default-rounds", type=int, default=1)
    parser.add_argument("--out")
    parser.add_argument("--pool", type=int, help="the export's threads, in place of TE's rule")
    parser.add_argument("--intra-op", type=int, help="torch.set_num_threads() first")
    args = parser.parse_args()
    if args.intra_op:
        torch.set_num_threads(args.intra_op)
    if args.pool is not None:
        fused_adam._offload_threads = lambda: args.pool
    procs = int(os.environ.get("WORLD_SIZE", "1"))
    if procs > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if procs > 1 else 0
    torch.cuda.set_device(0)
    threads = fused_adam._offload_threads()

    def barrier():
        torch.cuda.synchronize()
        if procs > 1:
            dist.barrier()

    def slowest(seconds):
        if procs == 1:
            return seconds
        t = torch.tensor([seconds])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    for moments in args.moments:
        opt = build(2**args.total_log2 // procs, moments)
        first = None
        for rnd in range(args.rounds):
            for design in args.designs:
                if design == "default" and rnd >= args.default_rounds:
                    continue
                gc.collect()
                barrier()
                start = time.perf_counter()
                sd = export(opt, design)
                seconds = slowest(time.perf_counter() - start)
                size = nbytes(sd) * procs
                if first is None:
                    first, ok = sd, True
                elif rnd > 0:
                    ok = None  # checked on each design's first export
                else:
                    ok = same(sd, first)
                    if procs > 1:
                        t = torch.tensor([int(ok)])
                        dist.all_reduce(t, op=dist.ReduceOp.MIN)
                        ok = bool(t.item())
                row = {
                    "design": design,
                    "moments": moments,
                    "procs": procs,
                    "round": rnd,
                    "seconds": round(seconds, 3),
                    "GBps": round(size / seconds / 1e9, 2),
                    "same": ok,
                    "intra_op": torch.get_num_threads(),
                    "omp": os.environ.get("OMP_NUM_THREADS"),
                    "threads": threads,
                    "rule": args.pool is None,
                    "elements": 2**args.total_log2,
                    "torch": torch.__version__,
                    "te": transformer_engine.__version__,
                }
                if sd is not first:
                    del sd
                if rank == 0:
                    print(json.dumps(row), flush=True)
                    if args.out:
                        with open(args.out, "a", encoding="utf-8") as f:
                            f.write(json.dumps(row) + "\n")
        del opt, first
        gc.collect()
        torch.cuda.empty_cache()
    if procs > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
