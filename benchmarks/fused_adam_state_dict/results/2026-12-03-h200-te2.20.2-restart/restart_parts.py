"""Two parts of a resume at 2^29 parameter elements per rank, apart: the template's pinned
allocation under the environment given, and the set of BF16 optimizer states from FP32 CPU
values.

  python3 restart_parts.py
  GLIBC_TUNABLES=glibc.malloc.hugetlb=1 PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,pinned_num_register_threads:16 python3 restart_parts.py

pinned_alloc_s: torch.empty(pin_memory=True) of the template's buffers (32 layers of a BF16
parameter and FP32 master weights, exp_avg, exp_avg_sq of 2^24 elements: 7 GiB), the first
allocation of the process. set_{pinned,pageable}_*: 2 x 32 FP32 tensors of 2^24 elements
(exp_avg, exp_avg_sq as the export gives them), in pinned memory (the buffers above) and in
pageable memory, into BF16 CUDA states: as FusedAdam's _apply_scale sets a BF16 state from CPU
values before PR 3 (cpu_convert: scaled.copy_(unscaled.bfloat16()), converted on the CPU and
copied from a new pageable tensor), converted on the GPU as PR 3 does from pinned memory
(gpu_convert: scaled.copy_(unscaled.to(scaled.device).bfloat16())), and by copy_(...,
non_blocking=True); twice each. bitwise: every way gives the states of the first. The
machine's transparent huge page settings and glibc beside.
"""

import json
import os
import platform
import time

import torch

LAYERS, ELEMENTS = 32, 1 << 24
DTYPES = (torch.bfloat16, torch.float32, torch.float32, torch.float32)


def _timed(function):
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = function()
    torch.cuda.synchronize()
    return result, round(time.perf_counter() - start, 3)


def _read(path):
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return None


def main():
    torch.set_num_threads(int(os.environ.get("THREADS", "16")))
    torch.empty(1, device="cuda")
    row = {
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
        "thp_enabled": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
        "thp_defrag": _read("/sys/kernel/mm/transparent_hugepage/defrag"),
        "glibc": platform.libc_ver()[1],
        "threads": torch.get_num_threads(),
    }
    buffers, row["pinned_alloc_s"] = _timed(
        lambda: [
            torch.empty(ELEMENTS, dtype=d, pin_memory=True) for _ in range(LAYERS) for d in DTYPES
        ]
    )
    row["gib"] = round(sum(b.nbytes for b in buffers) / 2**30, 3)
    with open("/proc/self/smaps_rollup", encoding="ascii") as f:
        huge = [l for l in f if l.startswith("AnonHugePages:")]
    row["anon_huge_gib"] = round(int(huge[0].split()[1]) / 2**20, 3) if huge else None
    for b in buffers:
        b.copy_(torch.randn(ELEMENTS, device="cuda"))
    moments = [b for i, b in enumerate(buffers) if i % 4 >= 2]  # exp_avg, exp_avg_sq
    pageable = [torch.empty_like(b, pin_memory=False).copy_(b) for b in moments]
    states = [torch.empty(ELEMENTS, dtype=torch.bfloat16, device="cuda") for _ in moments]
    kept = {}
    for name, convert in (
        ("cpu_convert", lambda s, u: s.copy_(u.bfloat16())),
        ("gpu_convert", lambda s, u: s.copy_(u.to(s.device).bfloat16())),
        ("copy_non_blocking", lambda s, u: s.copy_(u, non_blocking=True)),
    ):
        for memory, sources in (("pinned", moments), ("pageable", pageable)):
            for repeat in range(2):
                _, row[f"set_{memory}_{name}_s_{repeat}"] = _timed(
                    lambda: [convert(s, u) for s, u in zip(states, sources)]
                )
            kept[memory, name] = [s.clone() for s in states]
    first = kept.pop(("pinned", "cpu_convert"))
    row["bitwise"] = all(all(map(torch.equal, first, other)) for other in kept.values())
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
