"""What pinning a resume's template of 7 GiB costs, and what copying it to the GPU gets.

  python3 template_pin.py
  PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,pinned_num_register_threads:16 python3 template_pin.py

The template of one rank at 2^29 parameter elements (FP32 master weights, BF16 moments: 32
layers of a BF16 parameter and FP32 master weights, exp_avg, exp_avg_sq of 2^24 elements).
Rows: torch.empty(pin_memory=True) (PyTorch's host allocator, as CheckpointStager's buffers;
PYTORCH_CUDA_ALLOC_CONF chooses how it pins); pageable torch.empty, then written (fill_, with
--threads intra-op threads: the page faults that a read into it pays); cudaHostRegister of those
written buffers one after the other and from --threads threads at once; cudaHostRegister of
buffers never written (it faults them in); and the copy of all of them to the GPU
(non_blocking, then synchronize) from each kind of memory.
"""

import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch

LAYERS, ELEMENTS = 32, 1 << 24
DTYPES = (torch.bfloat16, torch.float32, torch.float32, torch.float32)


def _timed(function):
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = function()
    torch.cuda.synchronize()
    return result, round(time.perf_counter() - start, 3)


def _empty(pin):
    return [torch.empty(ELEMENTS, dtype=d, pin_memory=pin) for _ in range(LAYERS) for d in DTYPES]


def _register(buffers, threads):
    cudart = torch.cuda.cudart()

    def one(buffer):
        assert int(cudart.cudaHostRegister(buffer.data_ptr(), buffer.nbytes, 0)) == 0

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, buffers))


def _unregister(buffers):
    cudart = torch.cuda.cudart()
    for buffer in buffers:
        assert int(cudart.cudaHostUnregister(buffer.data_ptr())) == 0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.cuda.init()
    torch.empty(1, device="cuda")
    gpu = [torch.empty(ELEMENTS, dtype=d, device="cuda") for _ in range(LAYERS) for d in DTYPES]
    gib = sum(b.nbytes for b in gpu) / 2**30
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")

    def h2d(buffers):
        return _timed(lambda: [g.copy_(b, non_blocking=True) for g, b in zip(gpu, buffers)])[1]

    for repeat in range(args.repeats):
        row = dict(repeat=repeat, gib=gib, alloc_conf=conf, threads=args.threads)
        pinned, row["pinned_alloc_s"] = _timed(lambda: _empty(True))
        row["pinned_h2d_s"] = h2d(pinned)
        del pinned
        pageable, row["pageable_alloc_s"] = _timed(lambda: _empty(False))
        _, row["pageable_write_s"] = _timed(lambda: [b.fill_(1) for b in pageable])
        row["pageable_h2d_s"] = h2d(pageable)
        _, row["register_written_serial_s"] = _timed(lambda: _register(pageable, 1))
        row["registered_h2d_s"] = h2d(pageable)
        _unregister(pageable)
        _, row["register_written_threads_s"] = _timed(lambda: _register(pageable, args.threads))
        _unregister(pageable)
        del pageable
        fresh = _empty(False)
        _, row["register_unwritten_threads_s"] = _timed(lambda: _register(fresh, args.threads))
        _unregister(fresh)
        del fresh
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
