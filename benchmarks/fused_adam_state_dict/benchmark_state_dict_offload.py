# Copyright (c) 2022-2026, NVIDIA CORPORATION & AFFILIATES. All rights reserved.
#
# See LICENSE for license information.

"""Benchmark FusedAdam state_dict() export to CPU and load_state_dict() from it: GPU peak,
host RSS peak, seconds, GB/s.

Modes, each over the same optimizer state (BF16 params, FP32 master weights, moments of
--moments dtype):
  default          state_dict() as upstream: FP32 copies stay on GPU (no CPU copy).
  default_then_cpu state_dict() then every tensor moved to CPU, as DCP's
                   get_optimizer_state_dict(cpu_offload=True) does today.
  convert_one      the earlier proposal: convert one state on GPU, move it to CPU, free it.
  offload          FusedAdam(state_dict_cpu_offload=True).
  load_default     load_state_dict() of the CPU export into the optimizer (which holds
                   state, as when resuming).
For exports, the GPU peak is above the memory allocated before; for loads, above the memory
allocated after (the loaded state). GB/s: bytes of the exported states per second.

Prints one JSON line per (size, mode) and, with --csv, appends the same rows to a CSV file.
Example:
  python benchmark_state_dict_offload.py --total-log2 28 30 --largest-log2 24 0 \
      --csv results.csv
(--largest-log2 0 means "one parameter holds all elements").
"""

import argparse
import csv
import gc
import json
import os
import platform
import threading
import time

import torch

import transformer_engine
import transformer_engine.pytorch as te

MODES = ("default", "default_then_cpu", "convert_one", "offload", "load_default")
MASTER = {"fp32": torch.float32, "fp16": torch.float16}
MOMENTS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.uint8, "fp32": torch.float32}


class HostPeak:
    """Peak resident set size of this process during a block, above its value before."""

    def __init__(self):
        self.before = self.peak = 0
        self._stop = threading.Event()
        self._thread = None

    @staticmethod
    def _rss():
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _sample(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self._rss())

    def __enter__(self):
        self.before = self.peak = self._rss()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def growth(self):
        """Bytes of RSS growth at the peak."""
        return self.peak - self.before


def to_cpu(obj):
    """Move every tensor of a state dict to CPU, as DCP's cpu_offload does."""
    if isinstance(obj, torch.Tensor):
        return obj.to("cpu")
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def export_convert_one(opt):
    """The earlier proposal: one FP32 copy on GPU at a time."""
    sd = {"state": {}, "param_groups": opt.state_dict_groups_only()}
    index = 0
    for group in opt.param_groups:
        for p in group["params"]:
            if p in opt.state:
                states = {}
                for name in opt.state[p]:
                    gpu = opt.get_unscaled_state(p, name)
                    states[name] = gpu.cpu()
                    del gpu
                sd["state"][index] = states
            index += 1
    return sd


def cpu_export(opt):
    """The optimizer's state dict on CPU, as a checkpoint gives it back."""
    opt.state_dict_cpu_offload = True
    sd = opt.state_dict()
    opt.state_dict_cpu_offload = False
    return sd


def exported_bytes(sd):
    """Bytes of every tensor in the exported states."""
    total = 0
    for v in sd["state"].values():
        for t in v.values():
            local = t._local_tensor if hasattr(t, "_local_tensor") else t
            total += local.numel() * local.element_size()
    return total


def build(total, largest, moments, master="fp32", square=False):
    """BF16 params of `total` elements (the largest `largest`) and a stepped FusedAdam. With
    `square`, each parameter of 4^k elements is a 2^k x 2^k matrix, else 1-D."""
    sizes = []
    rest = total
    while rest > 0:
        sizes.append(min(rest, largest))
        rest -= sizes[-1]
    if square:
        square_of = lambda n: (2 ** (n.bit_length() // 2),) * 2
        sizes = [square_of(n) if n & (n - 1) == 0 and n.bit_length() % 2 else n for n in sizes]
    params, opt = stepped_optimizer(sizes, moments, master)
    # Export helper for convert_one: param_groups without the states.
    opt.state_dict_groups_only = lambda: torch.optim.Optimizer.state_dict(opt)["param_groups"]
    return params, opt


def stepped_optimizer(shapes, moments, master="fp32"):
    """BF16 params of these shapes, normally distributed, and a FusedAdam that took one step
    (master weights of the dtype `master`, moments of the dtype `moments`)."""
    params = [
        torch.nn.Parameter(torch.empty(s, device="cuda", dtype=torch.bfloat16)) for s in shapes
    ]
    for p in params:
        p.data.normal_()
    opt = te.optimizers.FusedAdam(
        params,
        lr=1e-3,
        master_weights=True,
        master_weight_dtype=MASTER[master],
        exp_avg_dtype=MOMENTS[moments],
        exp_avg_sq_dtype=MOMENTS[moments],
    )
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    for p in params:
        p.grad = None
    return params, opt


def load(opt, sd):
    """load_state_dict(sd); return sd, for measuring it like an export."""
    opt.load_state_dict(sd)
    return sd


def run_mode(opt, mode, cpu_sd=None):
    """Export (or load `cpu_sd`) once in `mode`; return the measurements."""
    opt.state_dict_cpu_offload = mode == "offload"
    exports = {
        "default": opt.state_dict,
        "default_then_cpu": lambda: to_cpu(opt.state_dict()),
        "convert_one": lambda: export_convert_one(opt),
        "offload": opt.state_dict,
        "load_default": lambda: load(opt, cpu_sd),
    }
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    gpu_before = torch.cuda.memory_allocated()
    with HostPeak() as host:
        start = time.perf_counter()
        sd = exports[mode]()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    if mode.startswith("load"):
        gpu_peak = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
    else:
        gpu_peak = torch.cuda.max_memory_allocated() - gpu_before
    nbytes = exported_bytes(sd)
    on_cpu = all(
        (t._local_tensor if hasattr(t, "_local_tensor") else t).device.type == "cpu"
        for v in sd["state"].values()
        for t in v.values()
    )
    del sd
    gc.collect()
    opt.state_dict_cpu_offload = False
    return {
        "gpu_peak_bytes": gpu_peak,
        "gpu_peak_gib": round(gpu_peak / 2**30, 4),
        "host_rss_growth_bytes": host.growth,
        "host_rss_growth_gib": round(host.growth / 2**30, 4),
        "seconds": round(seconds, 4),
        "exported_bytes": nbytes,
        "gb_per_s": round(nbytes / seconds / 1e9, 3),
        "states_on_cpu": on_cpu,
    }


def main():
    """Run the grid and print JSON lines."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-log2", type=int, nargs="+", default=[28, 30])
    parser.add_argument(
        "--largest-log2", type=int, nargs="+", default=[24, 0], help="0: one parameter"
    )
    parser.add_argument("--moments", choices=sorted(MOMENTS), default="bf16")
    parser.add_argument("--master", choices=sorted(MASTER), default="fp32")
    parser.add_argument(
        "--square", action="store_true", help="parameters of 4^k elements as 2^k x 2^k matrices"
    )
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument(
        "--slow-modes-max-log2",
        type=int,
        default=30,
        help="skip default_then_cpu and convert_one above this total size",
    )
    parser.add_argument("--csv", help="append the rows to this CSV file")
    args = parser.parse_args()

    env = {
        "te": transformer_engine.__version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(),
        "python": platform.python_version(),
        "cpus": len(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS", ""),
    }
    print(json.dumps({"env": env}), flush=True)

    # Warm up CUDA, the pinned-memory allocator and the export threads once.
    _, opt = build(2**20, 2**20, args.moments, args.master)
    cpu_sd = cpu_export(opt)
    for mode in args.modes:
        run_mode(opt, mode, cpu_sd)
    del opt, cpu_sd

    rows = []
    for total_log2 in args.total_log2:
        for largest_log2 in args.largest_log2:
            largest_log2 = total_log2 if largest_log2 == 0 else largest_log2
            if largest_log2 > total_log2:
                continue
            params, opt = build(
                2**total_log2, 2**largest_log2, args.moments, args.master, args.square
            )
            cpu_sd = cpu_export(opt) if any(m.startswith("load") for m in args.modes) else None
            for mode in args.modes:
                if (
                    mode in ("default_then_cpu", "convert_one", "load_default")
                    and total_log2 > args.slow_modes_max_log2
                ):
                    continue
                row = dict(
                    env,
                    moments=args.moments,
                    master=args.master,
                    shape=list(params[0].shape),
                    total_numel_log2=total_log2,
                    largest_numel_log2=largest_log2,
                    num_params=len(params),
                    mode=mode,
                    **run_mode(opt, mode, cpu_sd),
                )
                rows.append(row)
                print(json.dumps(row), flush=True)
            del params, opt, cpu_sd
            gc.collect()
            torch.cuda.empty_cache()

    if args.csv:
        new = not os.path.exists(args.csv)
        with open(args.csv, "a", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            if new:
                writer.writeheader()
            writer.writerows(rows)

    # Side by side: offload vs today's path, per size.
    for row in rows:
        if row["mode"] != "offload":
            continue
        today = "default_then_cpu"
        base = [
            r
            for r in rows
            if r["mode"] == today
            and r["total_numel_log2"] == row["total_numel_log2"]
            and r["largest_numel_log2"] == row["largest_numel_log2"]
        ]
        if base:
            print(
                f"# N=2^{row['total_numel_log2']} largest=2^{row['largest_numel_log2']} "
                f"threads={env['torch_threads']}: {row['mode']} {row['gb_per_s']} GB/s, "
                f"+{row['gpu_peak_bytes'] / 2**20:.1f} MiB GPU; today "
                f"{base[0]['gb_per_s']} GB/s, +{base[0]['gpu_peak_gib']} GiB GPU; "
                f"speedup {row['gb_per_s'] / base[0]['gb_per_s']:.1f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()
