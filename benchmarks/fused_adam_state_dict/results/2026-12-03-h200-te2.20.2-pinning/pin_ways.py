"""Ways to make the resume template's 7 GiB of pinned host memory, each in its own process (the
process's first pinned allocation), one JSON line per run:

  python3 pin_ways.py --make-file /tmp/pin_ways.bin       # once: the 7 GiB that `overlap` reads
  PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,pinned_num_register_threads:16 \
      GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python3 pin_ways.py --way torch --threads 1
  GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python3 pin_ways.py --way register --threads 16
  GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python3 pin_ways.py --way overlap --file /tmp/pin_ways.bin

The buffers are the template's at 2^29 parameter elements: 32 layers of a BF16 parameter and
FP32 master weights, exp_avg, exp_avg_sq of 2^24 elements.
  torch     torch.empty(pin_memory=True) of each buffer, from --threads threads (alloc_s).
  register  torch.empty() (pageable), its pages written (zero_(), intra-op threads: fault_s),
            then cudaHostRegister of each buffer from --threads threads (register_s).
  read      --file read into buffers made as `torch` makes them (16 threads, os.preadv, 64 MiB
            each): alloc_s, read_s, total_s: what the template + ParallelFileSystemReader do.
  overlap   --file read into pageable buffers, each registered (cudaHostRegister, --threads
            threads) once its reads are done, while the next ones are read: total_s until the
            last is registered.
Every way ends with pinned buffers (is_pinned() of each checked: pinned) and times a copy of
the FP32 moments (4 GiB) to the GPU from them (h2d_GBps).
"""

import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch

LAYERS, ELEMENTS = 32, 1 << 24
DTYPES = (torch.bfloat16, torch.float32, torch.float32, torch.float32)
SPECS = [d for _ in range(LAYERS) for d in DTYPES]
CHUNK = 64 << 20


def _register(buffer):
    error = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.nbytes, 0)
    if int(error) != 0:
        raise RuntimeError(f"cudaHostRegister: {error}")


def _pinned(dtype):
    return torch.empty(ELEMENTS, dtype=dtype, pin_memory=True)


def _map(threads, function, items):
    if threads == 1:
        return [function(i) for i in items]
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(function, items))


def _chunks(buffers):
    """(buffer index, file offset, byte view) of every read, in file order."""
    reads, offset = [], 0
    for index, buffer in enumerate(buffers):
        flat = buffer.view(-1).view(torch.uint8)
        for start in range(0, flat.numel(), CHUNK):
            part = flat[start : start + CHUNK]
            reads.append((index, offset + start, part))
        offset += flat.numel()
    return reads


def _read(fd, offset, view):
    done = os.preadv(fd, [memoryview(view.numpy())], offset)
    if done != view.numel():
        raise RuntimeError(f"short read at {offset}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--way", choices=["torch", "register", "read", "overlap"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--file")
    parser.add_argument("--make-file")
    args = parser.parse_args()
    if args.make_file:
        block = os.urandom(CHUNK)
        total = sum(ELEMENTS * d.itemsize for d in SPECS)
        with open(args.make_file, "wb") as f:
            for _ in range(total // CHUNK):
                f.write(block)
        return
    torch.set_num_threads(16)
    torch.empty(1, device="cuda")
    row = {
        "way": args.way,
        "threads": args.threads,
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
    }
    start = time.perf_counter()
    if args.way == "torch":
        buffers = _map(args.threads, _pinned, SPECS)
        row["alloc_s"] = time.perf_counter() - start
    elif args.way == "register":
        buffers = [torch.empty(ELEMENTS, dtype=d) for d in SPECS]
        row["alloc_s"] = time.perf_counter() - start
        for b in buffers:
            b.zero_()
        row["fault_s"] = time.perf_counter() - start - row["alloc_s"]
        mark = time.perf_counter()
        _map(args.threads, _register, buffers)
        row["register_s"] = time.perf_counter() - mark
    else:
        pinned = args.way == "read"
        buffers = [
            (_pinned if pinned else lambda d: torch.empty(ELEMENTS, dtype=d))(d) for d in SPECS
        ]
        row["alloc_s"] = time.perf_counter() - start
        reads = _chunks(buffers)
        left = [0] * len(buffers)
        for index, _, _ in reads:
            left[index] += 1
        fd = os.open(args.file, os.O_RDONLY)
        registrar = ThreadPoolExecutor(args.threads)
        registered = []
        with ThreadPoolExecutor(16) as pool:
            futures = [(i, pool.submit(_read, fd, o, v)) for i, o, v in reads]
            for index, future in futures:  # in file order: a buffer's reads end in order
                future.result()
                left[index] -= 1
                if left[index] == 0 and not pinned:
                    registered.append(registrar.submit(_register, buffers[index]))
        row["read_s"] = time.perf_counter() - start - row["alloc_s"]
        for future in registered:
            future.result()
        registrar.shutdown()
        os.close(fd)
    row["total_s"] = time.perf_counter() - start
    row["pinned"] = all(b.is_pinned() for b in buffers)
    moments = [b for b, d in zip(buffers, SPECS) if d == torch.float32][LAYERS:]
    gpu = torch.empty(ELEMENTS * len(moments), dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()
    mark = time.perf_counter()
    for i, b in enumerate(moments):
        gpu[i * ELEMENTS : (i + 1) * ELEMENTS].copy_(b, non_blocking=True)
    torch.cuda.synchronize()
    row["h2d_GBps"] = gpu.nbytes / 1e9 / (time.perf_counter() - mark)
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))


if __name__ == "__main__":
    main()
