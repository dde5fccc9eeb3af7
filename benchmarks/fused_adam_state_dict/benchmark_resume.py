# Copyright (c) 2022-2026, NVIDIA CORPORATION & AFFILIATES. All rights reserved.
#
# See LICENSE for license information.

"""The resume a restart pays: a DCP checkpoint loaded into a new model and optimizer, DCP's
way against CheckpointStager's template read by ParallelFileSystemReader.

  torchrun --nproc_per_node=N benchmark_resume.py --local-log2 29 --cold --out resume.jsonl
  torchrun --nproc_per_node=N benchmark_resume.py --threads-sweep 1 4 8 16 --out resume.jsonl

Per rank: 2^local-log2 BF16 parameter elements (benchmark_dcp_checkpoint.py's FSDP2 model and
FusedAdam(state_dict_cpu_offload=True), FP32 master weights,
BF16 moments). It trains --steps steps, saves a checkpoint under --ckpt-dir as users do (dcp.save
of get_model_state_dict and get_optimizer_state_dict, cpu_offload=True), then --repeats times
resumes it per variant into a new model and optimizer (no step: the template makes the states):

  standard  template: get_model_state_dict / get_optimizer_state_dict(cpu_offload=True);
            dcp.load(checkpoint_id=...); set_model_state_dict + set_optimizer_state_dict
  parallel  template: CheckpointStager(async_staging=True).load_template() of the model state
            dict and an optimizer_snapshot() (its pinned buffers); dcp.load with
            ParallelFileSystemReader(thread_count=--threads); the same setters; then the
            template dropped, the next checkpoint's staging by the same stager timed
            (next_stage_s, until its copies are done; next_reused: into the template's buffers,
            none made anew), and the stager closed

Warm: the checkpoint as just written, in the page cache. --cold adds the resumes cold, every
file of the checkpoint fsync'ed and evicted (posix_fadvise DONTNEED) before each (cached_fraction:
what mincore still finds cached then; near 1 where the directory is in memory, as on a tmpfs),
after disk_GBps, the disk's own read speed: the evicted files read by --threads threads, os.preadv
of 64 MiB chunks. --threads-sweep T... runs only parallel, warm, once per thread count (rows with
sweep true).

One JSON line per resume (rank 0; seconds of the slowest rank, each phase between
torch.cuda.synchronize() and barriers): variant, cold, threads, repeat, sweep, GB (checkpoint
bytes on disk / 1e9), template_s, dcp_load_s, set_s, resume_s (dcp_load_s + set_s: the
checkpoint read and loaded), total_s (the three), GBps (GB / resume_s), host_peak_GiB (the process's resident
peak during the resume, VmHWM reset through /proc/self/clear_refs, above its resident memory
before: pinned pages included, the page cache not), gpu_peak_gib (above allocated before),
bitwise (the optimizer states as the export gives them and the local parameter shards equal to
the saved ones on every rank), fast_items and other_items (parallel: items read straight into
the template, and the others), next_stage_s and next_reused (parallel: above), disk_GBps and cached_fraction (cold rows), alloc_conf (PYTORCH_CUDA_ALLOC_CONF), the versions.
"""

import argparse
import ctypes
import gc
import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

import transformer_engine

# The model, the optimizer and the helpers of the DCP benchmark beside this one (run as a
# script, this folder is on sys.path).
from benchmark_dcp_checkpoint import GiB, OPTIONS, _build, _checkpoint_dir, _emit, _remove
from benchmark_dcp_checkpoint import _equal_on_all_ranks, _local_states, _max_over_ranks, _train

from te_fusedadam_offload.staging import CheckpointStager, ParallelFileSystemReader

CHUNK = 64 << 20  # one read of the disk measurement
_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t] + [ctypes.c_int] * 3 + [ctypes.c_long]
_LIBC.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
_LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def _files(path):
    return sorted(os.path.join(d, f) for d, _, names in os.walk(path) for f in names)


def _cached_pages(fd, size):
    """Pages of the file `fd` (of `size` bytes) in the page cache (mincore), or None."""
    addr = _LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        return None
    try:
        vec = ctypes.create_string_buffer((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE)
        if _LIBC.mincore(addr, size, vec) != 0:
            return None
        return sum(1 for b in vec.raw if b & 1)
    finally:
        _LIBC.munmap(addr, size)


def _evict(path):
    """Evict the checkpoint's files from the page cache (rank 0, the others wait); the
    fraction of their pages still cached afterwards (None where mincore fails)."""
    fraction = None
    if dist.get_rank() == 0:
        cached, pages = 0, 0
        for name in _files(path):
            fd = os.open(name, os.O_RDONLY)
            try:
                os.fsync(fd)  # dirty pages are not evicted
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                size = os.fstat(fd).st_size
                if size and cached is not None:
                    found = _cached_pages(fd, size)
                    cached = None if found is None else cached + found
                    pages += (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            finally:
                os.close(fd)
        fraction = None if cached is None or not pages else round(cached / pages, 4)
    dist.barrier()
    return fraction


def _disk_gbps(path, threads):
    """The disk's read speed (GB/s, rank 0's; None on the others): the evicted checkpoint
    read by `threads` threads, os.preadv of CHUNK bytes into a buffer per thread."""
    _evict(path)
    gbps, local = None, threading.local()

    def read(fd, offset, count):
        if not hasattr(local, "buffer"):
            local.buffer = memoryview(bytearray(CHUNK))
        done = 0
        while done < count:
            got = os.preadv(fd, [local.buffer[done:count]], offset + done)
            if got == 0:
                raise EOFError(f"a checkpoint file ends before {offset + count}")
            done += got

    if dist.get_rank() == 0:
        fds = [os.open(name, os.O_RDONLY) for name in _files(path)]
        try:
            sizes = [os.fstat(fd).st_size for fd in fds]
            chunks = [
                (fd, o, min(CHUNK, n - o)) for fd, n in zip(fds, sizes) for o in range(0, n, CHUNK)
            ]
            start = time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(read, *zip(*chunks)))
            gbps = round(sum(sizes) / (time.perf_counter() - start) / 1e9, 3)
        finally:
            for fd in fds:
                os.close(fd)
    dist.barrier()
    return gbps


def _resident_gib(key):
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024 / GiB
    return None


@contextmanager
def _phase(row, key):
    """Seconds of the block (slowest rank) into row[key]."""
    torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    yield
    torch.cuda.synchronize()
    row[key] = round(_max_over_ranks(time.perf_counter() - start), 3)
    dist.barrier()


def _params(model):
    """CPU copies of the model's local parameter shards."""
    return {
        n: (p._local_tensor if isinstance(p, DTensor) else p).detach().cpu()
        for n, p in model.named_parameters()
    }


def resume(args, row, path, saved):
    """One resume of row["variant"] into a new model and optimizer: row's figures."""
    model, optimizer, _ = _build(args, offload=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    gpu_before = torch.cuda.memory_allocated()
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")  # VmHWM = VmRSS
        host_before = _resident_gib("VmRSS")
    except OSError:
        host_before = None
    stager = reader = None
    if row["variant"] == "standard":
        with _phase(row, "template_s"):
            template = {
                "model": get_model_state_dict(model, options=OPTIONS),
                "optim": get_optimizer_state_dict(model, optimizer, options=OPTIONS),
            }
        with _phase(row, "dcp_load_s"):
            dcp.load(template, checkpoint_id=path)
        with _phase(row, "set_s"):
            set_model_state_dict(model, template["model"], options=OPTIONS)
            set_optimizer_state_dict(model, optimizer, template["optim"], options=OPTIONS)
    else:
        stager = CheckpointStager(async_staging=True)
        with _phase(row, "template_s"):
            template = stager.load_template(
                {
                    "model": get_model_state_dict(model),
                    "optim": stager.optimizer_snapshot(model, optimizer),
                }
            )
        with _phase(row, "dcp_load_s"):
            reader = ParallelFileSystemReader(path, thread_count=row["threads"])
            dcp.load(template, storage_reader=reader)
        with _phase(row, "set_s"):
            set_model_state_dict(model, template["model"])
            set_optimizer_state_dict(model, optimizer, template["optim"])
        row["fast_items"], row["other_items"] = reader.fast_items, reader.other_items
    peak = _resident_gib("VmHWM")
    row["host_peak_GiB"] = None if host_before is None else round(peak - host_before, 3)
    gpu_peak = torch.cuda.max_memory_allocated() - gpu_before
    row["gpu_peak_gib"] = round(_max_over_ranks(gpu_peak) / GiB, 3)
    del template
    if stager is not None:
        # The next checkpoint's staging into the template's buffers, the template dropped.
        pointers = stager._buffers.pointers()  # pylint: disable=protected-access
        with _phase(row, "next_stage_s"):
            state = {
                "model": get_model_state_dict(model),
                "optim": stager.optimizer_snapshot(model, optimizer),
            }
            stager.stage(state).result()
            stager.synchronize_staging()
        del state
        row["next_reused"] = stager._buffers.pointers() == pointers  # pylint: disable=W0212
        stager.close()
    states = _equal_on_all_ranks(saved[0], _local_states(optimizer))
    row["bitwise"] = _equal_on_all_ranks(saved[1], _params(model)) and states
    row["resume_s"] = round(row["dcp_load_s"] + row["set_s"], 3)
    row["total_s"] = round(row["template_s"] + row["resume_s"], 3)
    row["GBps"] = round(row["GB"] / row["resume_s"], 3)
    del model, optimizer
    gc.collect()
    torch.cuda.empty_cache()


def main():
    """Parse arguments, save the checkpoint, time the resumes, write the rows."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    parser.add_argument("--local-log2", type=int, default=29, help="parameter elements per rank")
    parser.add_argument("--largest-log2", type=int, default=24, help="elements per layer (even)")
    parser.add_argument("--steps", type=int, default=2, help="training steps before the save")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--variants", nargs="+", default=["standard", "parallel"], choices=["standard", "parallel"]
    )
    parser.add_argument("--threads", type=int, default=16, help="ParallelFileSystemReader's")
    parser.add_argument("--cold", action="store_true", help="also resume with the files evicted")
    parser.add_argument(
        "--threads-sweep", nargs="+", type=int, help="only parallel, warm, per thread count"
    )
    parser.add_argument("--ckpt-dir", default="/tmp/te_resume")
    parser.add_argument("--out", help="append the JSON lines to this file")
    args = parser.parse_args()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend="cpu:gloo,cuda:nccl")
    try:
        model, optimizer, width = _build(args, offload=True)
        _train(model, optimizer, width, args.steps)
        saved = (_local_states(optimizer), _params(model))
        path = _checkpoint_dir(args, "resume")
        state = {
            "model": get_model_state_dict(model, options=OPTIONS),
            "optim": get_optimizer_state_dict(model, optimizer, options=OPTIONS),
        }
        dcp.save(state, checkpoint_id=path)
        del state, model, optimizer
        gc.collect()
        torch.cuda.empty_cache()
        base = {
            "world_size": dist.get_world_size(),
            "local_log2": args.local_log2,
            "GB": round(sum(os.path.getsize(f) for f in _files(path)) / 1e9, 3),
            "gpu": torch.cuda.get_device_name(),
            "cpus": os.cpu_count(),
            # PyTorch's pinned allocation (pinned_use_cuda_host_register) makes the template
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
            "torch": torch.__version__,
            "te": transformer_engine.__version__,
        }
        runs = [("parallel", t, False, 0, True) for t in args.threads_sweep or ()]
        if not args.threads_sweep:
            for cold in (False, True) if args.cold else (False,):
                for repeat in range(args.repeats):
                    runs += [(v, args.threads, cold, repeat, False) for v in args.variants]
        disk = {}
        for variant, threads, cold, repeat, sweep in runs:
            if cold and not disk:
                disk["disk_GBps"] = _disk_gbps(path, args.threads)
            row = dict(base, variant=variant, cold=cold, repeat=repeat, sweep=sweep)
            row["threads"] = threads if variant == "parallel" else None
            if cold:
                row.update(disk, cached_fraction=_evict(path))
            resume(args, row, path, saved)
            _emit(args, row)
        _remove(path)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
