# Copyright (c) 2022-2026, NVIDIA CORPORATION & AFFILIATES. All rights reserved.
#
# See LICENSE for license information.

"""The design table of FusedAdam's CPU export: each way of getting the optimizer states to CPU
in FP32, side by side in one process, first export and steady state.

  python benchmark_export_designs.py --out designs.jsonl              # torch's default threads
  OMP_NUM_THREADS=1 python benchmark_export_designs.py --out designs.jsonl

Optimizer: BF16 parameters of N = 2^--total-log2 elements, FP32 master weights, moments of each
--moments dtype, one step taken; the parameters either one large one (`one_large`) or the mix
of a GPT-like model (`model_mix`: 65536 x 4096 embedding, 4 layers of hidden 4096 with their
QKV, projection, MLP, biases and layer norms). Designs:

  default          state_dict() then .cpu() of every tensor, as DCP's cpu_offload does today
  loop             the simplest bounded loop: each 16 MiB piece converted to FP32 on the GPU and
                   copied to the CPU tensor with .copy_() (pageable; no threads, no pinned memory)
  pipeline_e42bac8 PR 1's pipeline before this table (commit e42bac8): pinned ring, CPU threads
                   that wait for CUDA events, thread count from CPUs, LOCAL_WORLD_SIZE, threads
  threads_W        PR 1 as patched into this TE (state_dict_cpu_offload=True) with W CPU threads
                   (NVTE_FUSED_ADAM_STATE_DICT_THREADS=W): no CUDA calls in the threads
  pinned_out       the CPU tensors allocated pinned (PyTorch's caching host allocator, so kept
                   between exports) and filled by the copy engine: holds host memory
  stager_snapshot  te_fusedadam_offload.staging.CheckpointStager(async_staging=True), one for
                   all exports, staging stager.optimizer_snapshot(): the states' own bytes
                   copied into pinned buffers it keeps (BF16 widened in place on CPU; FP16/FP8
                   unscaled on the GPU by get_unscaled_state): holds host memory until
                   close(); copies_s is from stage() (which also maps the names) until the
                   GPU copies are done (what step() waits for), stager_pinned_bytes what the
                   stager keeps; after its exports, a row with closed=true: the host memory
                   after close()
Each design exports --exports times in a row (--slow-exports for default and loop), the
previous state dict dropped first; index 0 is the first export, the others the steady state.
Rows (JSON lines): design, moments, shape, export (first / steady), index, seconds, gb_per_s
(bytes of the FP32/int16 export per second), gpu_peak_bytes (above what was allocated before),
rss_gib and pinned_bytes held afterwards (the state dict dropped; pinned: PyTorch's host cache,
reserved), torch_threads, omp_num_threads, workers. Each export is checked against the first
design's on the first and last 2^20 elements of every state.
"""

import argparse
from collections import deque
from concurrent.futures import ThreadPoolExecutor
import gc
import json
import os
import statistics
import time

import torch

import transformer_engine
from transformer_engine.pytorch.optimizers import fused_adam

# The stager's own emptying of PyTorch's pinned cache (torch.accelerator's, or torch._C's before).
from te_fusedadam_offload.staging import CheckpointStager
from te_fusedadam_offload.staging.stager import empty_host_cache

# Run as a script, this folder is on sys.path.
from benchmark_state_dict_offload import exported_bytes, stepped_optimizer, to_cpu

PIECE = 4 * 1024 * 1024  # FP32 elements of a 16 MiB piece


def model_mix_shapes(hidden=4096, vocab=65536, layers=4):
    """Parameter shapes of a GPT-like model: about 2^30 elements at the defaults."""
    shapes = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [(3 * hidden, hidden), (3 * hidden,), (hidden, hidden), (hidden,)]
        shapes += [(hidden,), (hidden,), (4 * hidden, hidden), (4 * hidden,)]
        shapes += [(hidden, 4 * hidden), (hidden,), (hidden,), (hidden,)]
    return shapes + [(hidden,), (hidden,)]


def build(shapes, moments):
    """BF16 parameters of these shapes and a FusedAdam that took one step."""
    return stepped_optimizer(shapes, moments)[1]


def _states(opt):
    """(index, param, name) of every state, in state_dict() order."""
    params = [p for g in opt.param_groups for p in g["params"]]
    return [(i, p, name) for i, p in enumerate(params) for name in opt.state[p]]


def _unscaled_piece(opt, param, name, start, out):
    """FP32 (or int16) values of a piece of a state, made on the GPU as get_unscaled_state()
    makes them; `out` is a GPU scratch of the piece's size or larger."""
    state = opt.state[param][name]
    if isinstance(state, fused_adam.Float8Tensor):
        data = state._data.view(fused_adam.TE_DType_To_Torch[state._fp8_dtype]).view(-1)
        block = data[start : start + PIECE]
        return out[: block.numel()].copy_(block).mul_(state._scale_inv)
    block = state.view(-1)[start : start + PIECE]
    if block.dtype in (torch.float32, torch.int16):
        return block
    out = out[: block.numel()].copy_(block)
    if opt.name_to_dtype_map[name] == torch.float16:
        out.mul_(opt._scales[param][name])
    return out


def export_loop(opt):
    """The simplest bounded loop: every piece converted on the GPU and copied to CPU."""
    sd = {"state": {}, "param_groups": torch.optim.Optimizer.state_dict(opt)["param_groups"]}
    scratch = torch.empty(PIECE, dtype=torch.float32, device="cuda")
    for index, param, name in _states(opt):
        state = opt.state[param][name]
        dtype = torch.int16 if state.dtype == torch.int16 else torch.float32
        out = torch.empty(state.shape, dtype=dtype)
        flat = out.view(-1)
        for start in range(0, flat.numel(), PIECE):
            piece = _unscaled_piece(opt, param, name, start, scratch)
            flat[start : start + piece.numel()].copy_(piece)
        sd["state"].setdefault(index, {})[name] = out
    return sd


def export_pinned_out(opt):
    """CPU tensors from PyTorch's pinned-memory cache, filled by the copy engine."""
    sd = {"state": {}, "param_groups": torch.optim.Optimizer.state_dict(opt)["param_groups"]}
    scratch = [torch.empty(PIECE, dtype=torch.float32, device="cuda") for _ in range(2)]
    count = 0
    for index, param, name in _states(opt):
        state = opt.state[param][name]
        dtype = torch.int16 if state.dtype == torch.int16 else torch.float32
        out = torch.empty(state.shape, dtype=dtype, pin_memory=True)
        flat = out.view(-1)
        for start in range(0, flat.numel(), PIECE):
            piece = _unscaled_piece(opt, param, name, start, scratch[count % 2])
            flat[start : start + piece.numel()].copy_(piece, non_blocking=True)
            count += 1
        sd["state"].setdefault(index, {})[name] = out
    torch.cuda.synchronize()
    return sd


class PipelineE42bac8:
    """PR 1's copier as of commit e42bac8 (its _CopyToCPU and _offload_workers), kept here to
    measure it beside the current one: CPU threads wait for CUDA events themselves."""

    def __init__(self):
        num_cpus = len(os.sched_getaffinity(0))
        local_world_size = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        if num_cpus * local_world_size > (os.cpu_count() or num_cpus):
            num_cpus //= local_world_size
        workers = max(1, min(num_cpus // min(torch.get_num_threads(), 4), 16))
        self.workers = workers
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="e42bac8")
        self._buffers = [None] * min(max(4, 2 * workers), 16)
        self._pending = deque()
        self._submitted = 0
        self._pieces = []
        self._used = 0
        self._device = None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_value, traceback):
        try:
            if exc_type is None:
                self._submit()
                while self._pending:
                    self._pending.popleft().result()
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def copy(self, src, dst):
        """As _CopyToCPU.copy."""
        nbytes = src.numel() * src.element_size()
        limit = fused_adam._OFFLOAD_BUFFER_BYTES
        if self._pieces and (self._used + nbytes > limit or src.device != self._device):
            self._submit()
        index = self._submitted % len(self._buffers)
        if not self._pieces:
            if len(self._pending) == len(self._buffers):
                self._pending.popleft().result()
            if self._buffers[index] is None:
                self._buffers[index] = torch.empty(limit, dtype=torch.uint8, pin_memory=True)
            self._used, self._device = 0, src.device
        staged = self._buffers[index][self._used : self._used + nbytes].view(src.dtype)
        self._used += -(-nbytes // 16) * 16
        staged.copy_(src, non_blocking=True)
        self._pieces.append((staged, dst))

    def _submit(self):
        if self._pieces:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self._device))
            self._pending.append(self._pool.submit(self._copy_out, event, self._pieces))
            self._submitted += 1
            self._pieces = []

    @staticmethod
    def _copy_out(event, pieces):
        event.synchronize()
        for staged, dst in pieces:
            dst.copy_(staged)


def export_pipeline_e42bac8(opt):
    """PR 1's export with the copier of commit e42bac8 (the same _export_state)."""
    sd = {"state": {}, "param_groups": torch.optim.Optimizer.state_dict(opt)["param_groups"]}
    with PipelineE42bac8() as to_cpu:
        for index, param, name in _states(opt):
            sd["state"].setdefault(index, {})[name] = opt._export_state(param, name, to_cpu)
    return sd


def export_stager_snapshot(opt, stager, timing):
    """The stager's snapshot of the optimizer, complete (copied and widened)."""
    model = torch.nn.ParameterList(p for g in opt.param_groups for p in g["params"])
    start = time.perf_counter()
    future = stager.stage({"optim": stager.optimizer_snapshot(model, opt)})
    torch.cuda.synchronize()
    timing["copies_s"] = round(time.perf_counter() - start, 4)
    sd = future.result()["optim"]  # keyed by names "0", "1", ... of the ParameterList
    return {"state": {int(k): v for k, v in sd["state"].items()}, "param_groups": []}


def export_threads(opt, threads):
    """PR 1 as patched into this TE, with `threads` CPU threads."""
    old = os.environ.get("NVTE_FUSED_ADAM_STATE_DICT_THREADS")
    os.environ["NVTE_FUSED_ADAM_STATE_DICT_THREADS"] = str(threads)  # read at each export
    opt.state_dict_cpu_offload = True
    try:
        return opt.state_dict()
    finally:
        opt.state_dict_cpu_offload = False
        if old is None:
            del os.environ["NVTE_FUSED_ADAM_STATE_DICT_THREADS"]
        else:
            os.environ["NVTE_FUSED_ADAM_STATE_DICT_THREADS"] = old


def _pinned_reserved():
    stats = torch.cuda.host_memory_stats()
    return stats.get("reserved_bytes.all.current", stats.get("reserved_bytes.current", -1))


def _rss_gib():
    with open("/proc/self/statm", encoding="ascii") as f:
        return round(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30, 3)


def _samples(sd):
    """The first and last 2^20 elements of every state, for checking designs against another."""
    return {
        (k, n): (t.view(-1)[: 1 << 20].clone(), t.view(-1)[-(1 << 20) :].clone())
        for k, s in sd["state"].items()
        for n, t in s.items()
    }


def _emit(row, out):
    """Print `row` as a JSON line, and append it to `out` (a file) if there is one."""
    print(json.dumps(row), flush=True)
    if out:
        out.write(json.dumps(row) + "\n")
        out.flush()


def main():
    """Run the table and print JSON lines, then a summary."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-log2", type=int, default=30)
    parser.add_argument("--moments", nargs="+", default=["bf16", "fp16", "fp8"])
    parser.add_argument("--shapes", nargs="+", default=["one_large", "model_mix"])
    parser.add_argument(
        "--designs",
        nargs="+",
        default=[
            "threads_8",
            "default",
            "loop",
            "pipeline_e42bac8",
            "threads_4",
            "threads_16",
            "pinned_out",
        ],
    )
    parser.add_argument("--exports", type=int, default=5)
    parser.add_argument("--slow-exports", type=int, default=2)
    parser.add_argument("--out", help="append the rows to this file")
    args = parser.parse_args()
    env = {
        "te": transformer_engine.__version__,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(),
        "cpus": len(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS", ""),
    }
    print(json.dumps({"env": env}), flush=True)
    out = (
        open(args.out, "a", encoding="utf-8") if args.out else None
    )  # pylint: disable=consider-using-with
    rows = []
    for moments in args.moments:
        for shape in args.shapes:
            shapes = (
                [(2 ** (args.total_log2 // 2), 2 ** (args.total_log2 - args.total_log2 // 2))]
                if shape == "one_large"
                else model_mix_shapes()
            )
            opt = build(shapes, moments)
            reference = None
            for design in args.designs:
                timing, stager = {}, None
                if design == "stager_snapshot":
                    stager = CheckpointStager(async_staging=True)
                    export = lambda: export_stager_snapshot(
                        opt, stager, timing
                    )  # pylint: disable=unnecessary-lambda-assignment
                elif design == "default":
                    export = lambda: to_cpu(
                        opt.state_dict()
                    )  # pylint: disable=unnecessary-lambda-assignment
                elif design == "loop":
                    export = lambda: export_loop(
                        opt
                    )  # pylint: disable=unnecessary-lambda-assignment
                elif design == "pipeline_e42bac8":
                    export = lambda: export_pipeline_e42bac8(
                        opt
                    )  # pylint: disable=unnecessary-lambda-assignment
                elif design == "pinned_out":
                    export = lambda: export_pinned_out(
                        opt
                    )  # pylint: disable=unnecessary-lambda-assignment
                else:
                    threads = int(design.split("_")[1])
                    export = lambda threads=threads: export_threads(
                        opt, threads
                    )  # pylint: disable=unnecessary-lambda-assignment
                count = args.slow_exports if design in ("default", "loop") else args.exports
                for index in range(count):
                    gc.collect()
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    before = torch.cuda.memory_allocated()
                    start = time.perf_counter()
                    sd = export()
                    torch.cuda.synchronize()
                    seconds = time.perf_counter() - start
                    gpu_peak = torch.cuda.max_memory_allocated() - before
                    nbytes = exported_bytes(sd)
                    samples = _samples(sd)
                    if reference is None:
                        reference = samples
                    same = all(
                        torch.equal(a, b)
                        for key, pair in reference.items()
                        for a, b in zip(pair, samples[key])
                    )
                    del sd
                    gc.collect()
                    row = dict(
                        env,
                        design=design,
                        moments=moments,
                        shape=shape,
                        num_params=len(shapes),
                        total_numel=sum(torch.Size(s).numel() for s in shapes),
                        export="first" if index == 0 else "steady",
                        index=index,
                        seconds=round(seconds, 4),
                        gb_per_s=round(nbytes / seconds / 1e9, 3),
                        gpu_peak_bytes=gpu_peak,
                        rss_gib=_rss_gib(),
                        pinned_bytes=_pinned_reserved(),
                        workers=(
                            int(design.split("_")[1])
                            if design.startswith("threads_")
                            else (PipelineE42bac8().workers if design == "pipeline_e42bac8" else 0)
                        ),
                        same_as_first_design=same,
                        **timing,
                    )
                    if stager is not None:  # torch 2.11's host stats have no reserved bytes
                        row["stager_pinned_bytes"] = stager.cached_bytes()
                    rows.append(row)
                    _emit(row, out)
                if stager is not None:  # the documented release: close()
                    stager.close()
                    gc.collect()
                    released = dict(env, design=design, moments=moments, shape=shape)
                    released.update(
                        closed=True, rss_gib=_rss_gib(), pinned_bytes=_pinned_reserved()
                    )
                    _emit(released, out)
                empty_host_cache()
            del opt
            gc.collect()
            torch.cuda.empty_cache()
    print("# design          moments shape     first GB/s  steady GB/s  GPU peak   pinned after")
    for moments in args.moments:
        for shape in args.shapes:
            base = [
                r
                for r in rows
                if (r["moments"], r["shape"], r["design"]) == (moments, shape, "default")
            ]
            base_gbps = statistics.median(r["gb_per_s"] for r in base) if base else None
            for design in args.designs:
                sel = [
                    r
                    for r in rows
                    if (r["moments"], r["shape"], r["design"]) == (moments, shape, design)
                ]
                if not sel:
                    continue
                steady = [r["gb_per_s"] for r in sel if r["export"] == "steady"]
                steady_gbps = statistics.median(steady) if steady else float("nan")
                ratio = f" {steady_gbps / base_gbps:5.1f}x" if base_gbps else ""
                print(
                    f"# {design:16s} {moments:7s} {shape:9s} {sel[0]['gb_per_s']:10.2f} {steady_gbps:11.2f}{ratio} {max(r['gpu_peak_bytes'] for r in sel) / 2**20:8.1f} MiB"
                    f" {sel[-1]['pinned_bytes'] / 2**20:8.1f} MiB"
                    f" same={all(r['same_as_first_design'] for r in sel)}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
