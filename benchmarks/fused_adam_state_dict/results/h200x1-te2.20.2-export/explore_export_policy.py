# Copyright (c) 2022-2026, NVIDIA CORPORATION & AFFILIATES. All rights reserved.
#
# See LICENSE for license information.

"""Measure what bounds the CPU side of FusedAdam's offloaded state_dict() export, with torch
alone (no TransformerEngine), to choose its worker policy (issue 14).

The export moves each GPU state through reused pinned buffers and converts it there into a
freshly allocated FP32 CPU tensor. This script times the parts and the whole pipeline with
knobs the real code does not expose:
  touch      writing N fresh FP32 elements (first touch: page faults and kernel zeroing) with
             W Python threads, each using the current torch intra-op threads;
  convert    converting 4 MiB of pinned moments into already touched FP32 memory with
             torch's intra-op threads (copy_, copy_ + mul_ by a scale, lookup table for FP8);
  pipeline   the export pipeline (pieces copied into pinned buffers on the current stream,
             converted by W threads once an event says so) over three states of N elements:
             two moments of --dtype and FP32 master weights, in 2^24-element tensors;
             FP8 converted on CPU (copy_, lookup table) or on the GPU into one FP32 buffer.
Figures are GB/s of FP32 output (12 bytes per element for the pipeline, as the export
benchmark counts). One JSON line per measurement. Run it once as it is and once with
THP_MEM_ALLOC_ENABLE=1 (torch reads it once per process) to see transparent huge pages.
"""

import argparse
import json
import mmap
import os
import platform
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import torch

PIECE = 2**24  # elements per tensor, as the export benchmark's parameters


def emit(**row):
    """Print one JSON line, with the thread settings."""
    row.update(
        threads=torch.get_num_threads(),
        thp_env=os.environ.get("THP_MEM_ALLOC_ENABLE", ""),
        cpus=len(os.sched_getaffinity(0)),
    )
    print(json.dumps(row), flush=True)


def machine():
    """The kernel, CPU, transparent huge page settings, memory and torch's thread settings."""

    def read(path):
        try:
            with open(path, encoding="ascii") as f:
                return f.read().strip()
        except OSError as e:
            return str(e)

    model = ""
    with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    emit(
        kind="machine",
        kernel=platform.release(),
        cpu=model,
        thp_enabled=read("/sys/kernel/mm/transparent_hugepage/enabled"),
        thp_defrag=read("/sys/kernel/mm/transparent_hugepage/defrag"),
        mem_total=read("/proc/meminfo").splitlines()[0],
        torch=torch.__version__,
        parallel=torch.__config__.parallel_info().splitlines()[:6],
    )


def alloc(numel, how):
    """A fresh, untouched FP32 CPU tensor."""
    if how == "empty":
        return torch.empty(numel, dtype=torch.float32)
    mm = mmap.mmap(-1, numel * 4, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if how == "mmap_thp":
        mm.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(mm, dtype=torch.float32)


def touch(total, workers, how, src):
    """First touch of `total` fresh FP32 elements by `workers` threads."""
    outs = [alloc(PIECE, how) for _ in range(total // PIECE)]

    def fill(i):
        for out in outs[i::workers]:
            out.copy_(src)

    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(fill, range(workers)))
    seconds = time.perf_counter() - start
    emit(kind="touch", how=how, workers=workers, GBps=total * 4 / seconds / 1e9)


def convert(dtype_name):
    """One thread converting 4 MiB pinned pieces into touched FP32 memory."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}[dtype_name]
    numel = 4 * 2**20 // dtype.itemsize
    staged = torch.randn(numel).to(dtype)
    staged = staged.pin_memory() if torch.cuda.is_available() else staged
    out = torch.zeros(numel, dtype=torch.float32)
    scale = torch.tensor([0.5])
    table = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float() * scale
    idx = torch.empty(numel, dtype=torch.int32)
    methods = {
        "copy": lambda: out.copy_(staged),
        "copy_mul": lambda: out.copy_(staged).mul_(scale),
        "mul_out": lambda: torch.mul(
            staged.float() if dtype_name == "fp8" else staged, scale, out=out
        ),
    }
    if dtype_name == "fp8":
        methods["lut"] = lambda: torch.index_select(
            table, 0, idx.copy_(staged.view(torch.uint8)), out=out
        )
    for name, fn in methods.items():
        fn()
        reps = 20
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        seconds = (time.perf_counter() - start) / reps
        emit(kind="convert", dtype=dtype_name, method=name, GBps=numel * 4 / seconds / 1e9)


def pipeline(total, dtype_name, workers, chunk, how, scaled, fp8_method, worker_threads, blocking):
    """The export pipeline over three states of `total` elements each."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}[dtype_name]
    local = threading.local()
    block = 2**18
    states = []
    for _ in range(total // PIECE):
        for d in (dtype, dtype, torch.float32):
            t = torch.empty(PIECE, dtype=torch.float32, device="cuda").uniform_(-1, 1)
            states.append(
                (t.to(d), torch.tensor([0.5]) if (scaled and d != torch.float32) else None)
            )
    gpu_scale = torch.tensor([0.5], device="cuda")
    scratch = None
    if fp8_method == "gpu" and dtype_name == "fp8":
        scratch = [torch.empty(chunk // 4, device="cuda") for _ in range(4)]
    torch.cuda.synchronize()
    buffers = [
        torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(max(4, 2 * workers))
    ]
    stream = torch.cuda.current_stream()

    def work(event, staged, dst, scale):
        if worker_threads and not getattr(local, "set", False):
            torch.set_num_threads(worker_threads)
            local.set = True
        event.synchronize()
        if staged.dtype == torch.float8_e4m3fn and fp8_method == "lut":
            # FP32 values of the 256 codes, scaled: index_select writes float(x) * scale.
            table = torch.arange(256, dtype=torch.uint8).view(staged.dtype).float() * scale
            if getattr(local, "idx", None) is None:
                local.idx = torch.empty(block, dtype=torch.int32)
            codes = staged.view(torch.uint8)
            for i in range(0, codes.numel(), block):
                n = min(block, codes.numel() - i)
                idx = local.idx[:n].copy_(codes[i : i + n])
                torch.index_select(table, 0, idx, out=dst[i : i + n])
            return
        dst.copy_(staged)
        if scale is not None:
            dst.mul_(scale)

    start = time.perf_counter()
    outs, pending, used = [], deque(), 0
    with ThreadPoolExecutor(workers) as pool:
        for src, scale in states:
            out = alloc(PIECE, how)
            outs.append(out)
            on_gpu = scratch is not None and src.dtype == torch.float8_e4m3fn
            step = chunk // (4 if on_gpu else src.element_size())
            for s in range(0, PIECE, step):
                if len(pending) == len(buffers):
                    pending.popleft().result()
                piece = src[s : s + step]
                if on_gpu:
                    piece = scratch[used % 4][: piece.numel()].copy_(piece).mul_(gpu_scale)
                staged = buffers[used % len(buffers)][: step * piece.element_size()]
                staged = staged.view(piece.dtype)
                used += 1
                staged.copy_(piece, non_blocking=True)
                if on_gpu:
                    scale = None
                event = torch.cuda.Event(blocking=blocking)
                event.record(stream)
                pending.append(pool.submit(work, event, staged, out[s : s + step], scale))
        while pending:
            pending.popleft().result()
    seconds = time.perf_counter() - start
    emit(
        kind="pipeline",
        dtype=dtype_name,
        workers=workers,
        chunk_MiB=chunk / 2**20,
        how=how,
        scaled=scaled,
        fp8_method=fp8_method if dtype_name == "fp8" else "",
        worker_threads=worker_threads,
        blocking=blocking,
        GBps=total * 12 / seconds / 1e9,
        seconds=seconds,
    )
    del states, outs


def main():  # pylint: disable=missing-function-docstring
    parser = argparse.ArgumentParser(description=__doc__.split("\n", maxsplit=1)[0])
    parser.add_argument("--parts", nargs="+", default=["machine", "touch", "convert", "pipeline"])
    parser.add_argument("--total-log2", type=int, default=30)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp16", "fp8"])
    parser.add_argument("--chunks-MiB", type=int, nargs="+", default=[4])
    parser.add_argument("--allocs", nargs="+", default=["empty"])
    parser.add_argument("--fp8-methods", nargs="+", default=["copy", "lut"])
    parser.add_argument("--worker-threads", type=int, default=0)
    parser.add_argument("--blocking", type=int, nargs="+", default=[0])
    args = parser.parse_args()
    total = 2**args.total_log2
    if "machine" in args.parts:
        machine()
    if "touch" in args.parts:
        src = torch.ones(PIECE)
        for how in args.allocs:
            for w in args.workers:
                touch(total, w, how, src)
    if "convert" in args.parts:
        for d in args.dtypes:
            convert(d)
    if "pipeline" in args.parts:
        for d in args.dtypes:
            for how in args.allocs:
                for chunk in args.chunks_MiB:
                    for m in args.fp8_methods if d == "fp8" else ["copy"]:
                        for w in args.workers:
                            for b in args.blocking:
                                pipeline(
                                    total,
                                    d,
                                    w,
                                    chunk * 2**20,
                                    how,
                                    d != "bf16",
                                    m,
                                    args.worker_threads,
                                    bool(b),
                                )


if __name__ == "__main__":
    main()
