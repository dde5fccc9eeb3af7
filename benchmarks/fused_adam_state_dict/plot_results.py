# Copyright (c) 2022-2026, NVIDIA CORPORATION & AFFILIATES. All rights reserved.
#
# See LICENSE for license information.

"""Plot a run of benchmark_state_dict_offload.py (its JSON lines) as PNG figures.

  python plot_results.py results/h200-te2.20.2/bench.jsonl --out results/h200-te2.20.2

Writes gpu_peak_vs_total.png, gpu_peak_vs_largest.png and throughput.png for the export
modes and, if the run has load modes, load.png, each with the command that regenerates it in
its footer. For a run of benchmark_dcp_checkpoint.py, dcp_checkpoint.png; for one of
benchmark_checkpoint_stall.py, checkpoint_stall.png (its --prepare rows as lines of their
own); for one of benchmark_resume.py, resume.png.
"""

import argparse
import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=wrong-import-position

LABELS = {
    "default_then_cpu": "today: state_dict() then .cpu() (DCP cpu_offload)",
    "convert_one": "earlier proposal: convert one state on GPU, move, free",
    "offload": "state_dict_cpu_offload=True",
}
MARKERS = {"default_then_cpu": "o", "convert_one": "s", "offload": "^"}


def load(path):
    """Rows of the benchmark, without the env lines."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if "mode" in row or "variant" in row:
                rows.append(row)
    return rows


def _footer(fig, source, env):
    fig.text(
        0.01,
        0.01,
        f"{env}\nregenerate: python benchmarks/fused_adam_state_dict/plot_results.py {source}",
        fontsize=6,
        color="gray",
    )


def _moments(row):
    return row.get("moments", "bf16")


def _env(rows):
    r = rows[0]
    moments = sorted({_moments(r).upper() for r in rows})
    return (
        f"{r['gpu']}, TE {r['te']}, torch {r['torch']}, {r['cpus']} CPUs,"
        f" {'/'.join(moments)} moments + FP32 master"
    )


def plot_peak(rows, source, out, vary):
    """Peak GPU memory of the export against total size (largest fixed) or largest size."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    threads = max(r["torch_threads"] for r in rows)
    rows = [r for r in rows if r["torch_threads"] == threads]
    if vary == "total":
        fixed = min(r["largest_numel_log2"] for r in rows)
        sel = [r for r in rows if r["largest_numel_log2"] == fixed]
        x_key, title = "total_numel_log2", f"largest parameter 2^{fixed} elements"
    else:
        fixed = max(r["total_numel_log2"] for r in rows)
        sel = [r for r in rows if r["total_numel_log2"] == fixed]
        x_key, title = "largest_numel_log2", f"total 2^{fixed} elements"
    for mode, label in LABELS.items():
        pts = sorted((r[x_key], r["gpu_peak_bytes"] / 2**30) for r in sel if r["mode"] == mode)
        if pts:
            ax.plot([2**x for x, _ in pts], [y for _, y in pts], marker=MARKERS[mode], label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("total state elements" if vary == "total" else "largest parameter elements")
    ax.set_ylabel("peak GPU memory during export (GiB above before)")
    ax.set_title(f"FusedAdam state_dict export, {title}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    _footer(fig, source, _env(rows))
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    name = "gpu_peak_vs_total.png" if vary == "total" else "gpu_peak_vs_largest.png"
    fig.savefig(out / name, dpi=120)
    plt.close(fig)


def _case(row):
    return (_moments(row), row["torch_threads"], row["total_numel_log2"], row["largest_numel_log2"])


def _cases(rows):
    """The (moments, threads, total, largest) cases of a run: by moments, most threads first,
    then by size."""
    return sorted({_case(r) for r in rows}, key=lambda c: (c[0], -c[1], c[2], c[3]))


def _row(rows, case, mode):
    """The row of `mode` for `case`, or None."""
    for r in rows:
        if _case(r) == case and r["mode"] == mode:
            return r
    return None


def _save_bars(fig, ax, cases, labels, source, rows, out, name):
    """Label the cases on the x axis, the axes with `labels` (y, title), and save `name`."""
    ax.set_xticks(range(len(cases)))
    moments = len({c[0] for c in cases}) > 1
    ax.set_xticklabels(
        [
            (f"{d.upper()}\n" if moments else "") + f"{t} thr\nN=2^{n}\nmax=2^{m}"
            for d, t, n, m in cases
        ],
        fontsize=7,
    )
    ax.set_ylabel(labels[0])
    ax.set_title(labels[1])
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    _footer(fig, source, _env(rows))
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(out / name, dpi=120)
    plt.close(fig)


def plot_throughput(rows, source, out):
    """Export GB/s per mode and case; offload bars are labelled with their ratio to today's."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    cases = _cases(rows)
    modes = [mode for mode in LABELS if any(r["mode"] == mode for r in rows)]
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        hits = [_row(rows, case, mode) for case in cases]
        xs = [j + (i - (len(modes) - 1) / 2) * width for j in range(len(cases))]
        vals = [hit["gb_per_s"] if hit else 0 for hit in hits]
        ax.bar(xs, vals, width, label=LABELS[mode])
        for x, hit, case in zip(xs, hits, cases):
            today = _row(rows, case, "default_then_cpu")
            if mode == "offload" and hit and today:
                ratio = hit["gb_per_s"] / today["gb_per_s"]
                ax.text(x, hit["gb_per_s"], f"{ratio:.1f}x", ha="center", va="bottom", fontsize=7)
    ax.set_ylim(
        0, 1.3 * max(r["gb_per_s"] for r in rows if r["mode"] in modes)
    )  # room for the legend
    labels = (
        "export throughput, GB/s of CPU output",
        "FusedAdam state_dict export to CPU (higher is better)",
    )
    _save_bars(fig, ax, cases, labels, source, rows, out, "throughput.png")


LOAD_LABELS = {
    "load_default": "today: load_state_dict()",
    "load_offload": "state_dict_cpu_offload=True",  # rows from before load_state_dict_in_place
    "load_in_place": "load_state_dict_in_place=True",
}


def plot_load(rows, source, out):
    """Load GB/s per mode and size, each bar labelled with its GPU peak above the loaded state."""
    rows = [r for r in rows if r["mode"] in LOAD_LABELS]
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(8, 4.5))
    cases = _cases(rows)
    width = 0.38
    for i, mode in enumerate(LOAD_LABELS):
        label = LOAD_LABELS[mode]  # on the first bar of the mode only
        for j, case in enumerate(cases):
            hit = _row(rows, case, mode)
            if hit is None:
                continue
            x = j + (i - 0.5) * width
            ax.bar(x, hit["gb_per_s"], width, color=f"C{i}", label=label)
            label = None
            peak = hit["gpu_peak_bytes"]
            text = f"{peak / 2**30:.1f} GiB" if peak >= 2**30 else f"{peak / 2**20:.0f} MiB"
            ax.text(x, hit["gb_per_s"], text, ha="center", va="bottom", fontsize=6)
    labels = (
        "load throughput, GB/s of CPU state dict",
        "FusedAdam load_state_dict from CPU; labels: GPU peak above the loaded state",
    )
    _save_bars(fig, ax, cases, labels, source, rows, out, "load.png")
    return True


DCP_BARS = [
    ("export (optimizer)", "save", "export_optim_s"),
    ("dcp.save", "save", "save_s"),
    ("async_save:\nblocked", "async_save", "blocked_s"),
    ("async_save, async\nstaging: blocked", "async_staged", "blocked_s"),
    ("the same, model state\non GPU: blocked", "async_staged_gpu_model", "blocked_s"),
    ("resume", "resume", "resume_s"),
]


def plot_dcp(rows, source, out):
    """benchmark_dcp_checkpoint.py: seconds per checkpoint step, default against the option."""
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for i, mode in enumerate(("default", "offload")):
        values = []
        for _, step, key in DCP_BARS:
            match = [r for r in rows if r["mode"] == mode and r["step"] == step]
            values.append(match[-1].get(key, 0) if match else 0)
        xs = [j + i * 0.4 for j in range(len(DCP_BARS))]
        label = "default" if mode == "default" else "state_dict_cpu_offload=True"
        ax.bar(xs, values, width=0.4, label=label)
        for x, v in zip(xs, values):
            ax.annotate(f"{v:.2f}", (x, v), ha="center", va="bottom", fontsize=7)
    ax.set_xticks([j + 0.2 for j in range(len(DCP_BARS))], [b[0] for b in DCP_BARS], fontsize=7)
    ax.set_ylabel("seconds (slowest rank)")
    first = rows[0]
    ax.set_title(
        f"FSDP2 + DCP checkpoint, {first['world_size']}x {first['gpu']}, 2^{first['local_log2']}"
        " BF16 parameter elements per rank, BF16 moments, FP32 master weights",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.subplots_adjust(bottom=0.25)
    env = f"torch {first['torch']}, TE {first['te']}, {first['cpus']} CPUs"
    _footer(fig, source, env)
    fig.savefig(out / "dcp_checkpoint.png", dpi=120)


STALL_LABELS = {
    "none": "none: the iteration without a checkpoint (the control)",
    "async_save": "dcp.async_save, its own staging",
    "default_stager": "DefaultStager, async staging, new per checkpoint",
    "te_stager": "CheckpointStager (pass-through, reused pinned model buffers)",
    "te_stager_async": "CheckpointStager(async_staging=True)",
    "te_snapshot": "CheckpointStager(async_staging=True) + stager.optimizer_snapshot()",
    "torch_checkpointing": "torch_checkpointing CheckpointManager, export requires_copy=False",
}


def plot_stall(rows, source, out):
    """benchmark_checkpoint_stall.py: stall per consecutive checkpoint, one panel per
    iteration length, a line per variant and mode."""
    lengths = [x for x in ("short", "long") if any(r["iteration"] == x for r in rows)]
    width = max(10, 6 * len(lengths))  # room for the legend and the title with one panel
    fig, axes = plt.subplots(1, len(lengths), figsize=(width, 6), squeeze=False)
    for ax, length in zip(axes[0], lengths):
        sel = [r for r in rows if r["iteration"] == length]
        for i, (variant, label) in enumerate(STALL_LABELS.items()):
            for offload, prepared, style, marker in (
                (False, False, "--", "x"),
                (True, False, "-", "o"),
                (False, True, ":", "+"),
                (True, True, ":", "s"),
            ):
                hits = [
                    r
                    for r in sel
                    if r["variant"] == variant
                    and r["offload"] == offload
                    and r.get("prepared", False) == prepared
                ]
                if hits:
                    pts = sorted((r["n"], r["stall_s"]) for r in hits)
                    mode = "option" if offload else "default"
                    name = label if variant == "none" else f"{label}, {mode}"  # no checkpoint
                    if prepared:  # the first checkpoint's buffers made by prepare() before it
                        first = hits[0]
                        name += (
                            f", prepare() before ({first['prepare_s']:.1f} s,"
                            f" {first['prepare_excess_s']:+.2f} s of training)"
                        )
                    ax.plot(*zip(*pts), style, marker=marker, color=f"C{i}", label=name)
        iteration = statistics.median(r["iteration_s"] for r in sel)
        ax.set_title(f"{length} iteration ({iteration:.2f} s)", fontsize=9)
        ax.set_xlabel("checkpoint (consecutive)")
        ax.set_ylabel("stall (s; linear within +-0.01 s)")
        # From hundredths of a second to tens of seconds, and the control's (and a stall's)
        # negative values: an iteration can be shorter than the median it is measured against.
        ax.set_yscale("symlog", linthresh=0.01)
        ax.axhline(0.1, color="gray", linewidth=0.5)  # 0.1 s, the aim of the snapshot
        ax.xaxis.get_major_locator().set_params(integer=True)
    handles, labels = axes[0][0].get_legend_handles_labels()
    ncol = 1 if any(r.get("prepared") for r in rows) else 2  # room for the prepare() figures
    fig.legend(
        handles, labels, loc="lower center", ncol=ncol, fontsize=7, bbox_to_anchor=(0.5, 0.06)
    )
    first = rows[0]
    fig.suptitle(
        f"Checkpoint stall, FSDP2, {first['world_size']}x {first['gpu']}, "
        f"2^{first['local_log2']} BF16 parameter elements per rank, BF16 moments, FP32 master",
        fontsize=9,
    )
    fig.subplots_adjust(bottom=0.38)
    _footer(fig, source, f"torch {first['torch']}, TE {first['te']}, {first['cpus']} CPUs")
    fig.savefig(out / "checkpoint_stall.png", dpi=120)


def _resume_bars(ax, rows):
    """resume_s per variant (the median of its repeats), warm and cold; the disk's limit."""
    variants = [v for v in ("standard", "parallel") if any(r["variant"] == v for r in rows)]
    conditions = [c for c in (False, True) if any(r["cold"] == c for r in rows)]
    for i, variant in enumerate(variants):
        label = variant  # on its first bar only
        for j, cold in enumerate(conditions):
            hits = [r for r in rows if r["variant"] == variant and r["cold"] == cold]
            if not hits:
                continue
            value = statistics.median(r["resume_s"] for r in hits)
            x = j + (i - (len(variants) - 1) / 2) * 0.4
            if variant == "parallel" and label:
                label += f" ({hits[0]['threads']} threads)"
            ax.bar(x, value, 0.4, color=f"C{i}", label=label)
            label = None
            text = f"{value:.2f} s\n{hits[0]['GB'] / value:.1f} GB/s"
            ax.text(x, value, text, ha="center", va="bottom", fontsize=7)
    disk = [r["disk_GBps"] for r in rows if r["cold"] and r.get("disk_GBps")]
    if disk:  # the checkpoint read at the disk's own speed
        j, limit = conditions.index(True), rows[0]["GB"] / disk[0]
        ax.hlines(limit, j - 0.45, j + 0.45, colors="gray", linestyles="--")
        ax.text(j, limit, f"disk: {disk[0]:.1f} GB/s", ha="center", va="bottom", fontsize=7)
    names = {False: "warm (page cache)", True: "cold (evicted)"}
    ax.set_xticks(range(len(conditions)), [names[c] for c in conditions])
    ax.set_ylabel("resume: dcp.load + set_*_state_dict (s, slowest rank)")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)


def plot_resume(rows, source, out):
    """benchmark_resume.py: the resume per variant, warm and cold, and the reader's thread
    sweep (--threads-sweep) where the run has one."""
    main_rows = [r for r in rows if not r.get("sweep")]
    sweep = {}
    for r in rows:
        if r.get("sweep"):
            sweep.setdefault(r["threads"], []).append(r["resume_s"])
    panels = bool(main_rows) + bool(sweep)
    fig, axes = plt.subplots(1, panels, figsize=(5 + 3.5 * panels, 4.5), squeeze=False)
    if main_rows:
        _resume_bars(axes[0][0], main_rows)
    if sweep:
        ax = axes[0][-1]
        threads = sorted(sweep)
        ax.plot(threads, [statistics.median(sweep[t]) for t in threads], marker="o")
        ax.set_xscale("log", base=2)
        ax.set_xticks(threads, [str(t) for t in threads])
        ax.set_xlabel("ParallelFileSystemReader threads (parallel, warm)")
        ax.set_ylabel("resume (s, slowest rank)")
        ax.grid(True, alpha=0.3)
    first = rows[0]
    fig.suptitle(
        f"Resume of a {first['GB']:.1f} GB DCP checkpoint, {first['world_size']}x {first['gpu']},"
        f" 2^{first['local_log2']} BF16 parameter elements per rank",
        fontsize=9,
    )
    _footer(fig, source, f"torch {first['torch']}, TE {first['te']}, {first['cpus']} CPUs")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(out / "resume.png", dpi=120)
    plt.close(fig)


def main():
    """Parse arguments, write the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("jsonl")
    parser.add_argument("--out", help="directory for the PNGs (default: beside the input)")
    args = parser.parse_args()
    rows = load(args.jsonl)
    out = Path(args.out) if args.out else Path(args.jsonl).parent
    out.mkdir(parents=True, exist_ok=True)
    if "dcp_load_s" in rows[0]:
        plot_resume(rows, args.jsonl, out)
        print(f"wrote {out}/resume.png")
        return
    if "variant" in rows[0]:
        plot_stall(rows, args.jsonl, out)
        print(f"wrote {out}/checkpoint_stall.png")
        return
    if "step" in rows[0]:
        plot_dcp(rows, args.jsonl, out)
        print(f"wrote {out}/dcp_checkpoint.png")
        return
    plot_peak(rows, args.jsonl, out, "total")
    plot_peak(rows, args.jsonl, out, "largest")
    plot_throughput(rows, args.jsonl, out)
    loads = ", load.png" if plot_load(rows, args.jsonl, out) else ""
    print(f"wrote {out}/gpu_peak_vs_total.png, gpu_peak_vs_largest.png, throughput.png{loads}")


if __name__ == "__main__":
    main()
