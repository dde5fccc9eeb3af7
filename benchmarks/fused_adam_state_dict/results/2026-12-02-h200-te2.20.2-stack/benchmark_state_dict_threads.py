# Copyright (c) 2022-2026, NVIDIA CORPORATION & AFFILIATES. All rights reserved.
#
# See LICENSE for license information.

"""Benchmark FusedAdam(state_dict_cpu_offload=True) exports of several processes at once on one
host, per NVTE_FUSED_ADAM_STATE_DICT_THREADS: the aggregate GB/s of the processes' exports.

Each of --processes worker processes (OMP_NUM_THREADS=1, as under torchrun) builds BF16
parameters of 2^--numel-log2 elements in parameters of 2^24 on GPU 0 (FP32 master weights,
BF16 moments, one step), then, for --rounds rounds, for each value of --threads in turn, all
workers export at the same moment (the parent releases them together) with that value of the
environment variable; a round's time is from the release to the last worker's end. The
threads are interleaved so that every value sees the same host. One JSON row per (processes,
threads, round): the aggregate GB/s (all processes' FP32 bytes over the round's time), and
each worker's own seconds.

  python benchmark_state_dict_threads.py --processes 8 1 --threads 16 2 1 --out threads.jsonl
"""

import argparse
import json
import os
import subprocess
import sys
import time

VARIABLE = "NVTE_FUSED_ADAM_STATE_DICT_THREADS"


def worker(numel_log2):
    """Build, say "ready", then export once per line read from stdin (the threads' value)."""
    import torch  # pylint: disable=import-outside-toplevel

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from benchmark_state_dict_offload import build  # pylint: disable=import-outside-toplevel

    _, opt = build(2**numel_log2, min(2**24, 2**numel_log2), "bf16")
    opt.state_dict_cpu_offload = True
    torch.cuda.synchronize()
    print("ready", flush=True)
    for line in sys.stdin:
        os.environ[VARIABLE] = line.strip()
        start = time.perf_counter()
        sd = opt.state_dict()
        seconds = time.perf_counter() - start
        nbytes = sum(t.numel() * t.element_size() for s in sd["state"].values() for t in s.values())
        del sd
        print(json.dumps({"seconds": seconds, "bytes": nbytes}), flush=True)


def run(processes, args, out):
    """Start the workers, run the rounds, write the rows."""
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0"),
    )
    workers = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", str(args.numel_log2)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(processes)
    ]
    try:
        for w in workers:
            assert w.stdout.readline().strip() == "ready"
        for round_ in range(args.rounds):
            for threads in args.threads:
                start = time.perf_counter()
                for w in workers:
                    w.stdin.write(f"{threads}\n")
                    w.stdin.flush()
                results = [json.loads(w.stdout.readline()) for w in workers]
                wall = time.perf_counter() - start
                total = sum(r["bytes"] for r in results)
                row = {
                    "processes": processes,
                    "threads": threads,
                    "round": round_,
                    "numel_log2_per_process": args.numel_log2,
                    "cpus": len(os.sched_getaffinity(0)),
                    "seconds": round(wall, 4),
                    "aggregate_gb_per_s": round(total / wall / 1e9, 3),
                    "worker_seconds": [round(r["seconds"], 4) for r in results],
                }
                print(json.dumps(row), flush=True)
                out.write(json.dumps(row) + "\n")
                out.flush()
    finally:
        for w in workers:
            w.stdin.close()
        for w in workers:
            w.wait(timeout=60)


def main():
    """Parse the arguments; a worker, or the parent of the workers."""
    if sys.argv[1:2] == ["--worker"]:
        worker(int(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[8, 1])
    parser.add_argument("--threads", nargs="+", default=["16", "2", "1"])
    parser.add_argument("--numel-log2", type=int, default=28)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    with open(args.out, "a", encoding="utf-8") as out:
        for processes in args.processes:
            run(processes, args, out)


if __name__ == "__main__":
    main()
