# Copyright (c) 2022-2026, NVIDIA CORPORATION & AFFILIATES. All rights reserved.
#
# See LICENSE for license information.

"""The checkpoint stall that training sees, over consecutive checkpoints.

  torchrun --nproc_per_node=N benchmark_checkpoint_stall.py --local-log2 29 --out stall.jsonl

Per rank: 2^local-log2 BF16 parameter elements (square bias-free Linear layers of
2^largest-log2 elements each, sharded with fully_shard), FP32 master weights, BF16 moments,
FusedAdam with state_dict_cpu_offload False ("default") or True ("offload"); with
--store-param-remainders, FusedAdam(store_param_remainders=True) (as NeMo Automodel configures
it): the master weights kept as the int16 remainders of the BF16 parameters, and exported as
such (2 bytes an element in place of FP32's 4: a checkpoint of 6 GiB per 2^29 elements in
place of 7).

A training iteration is forward + backward over --microbatches micro-batches of --batch rows,
then optimizer.step(). The stall of a checkpoint is how much later the next iteration ends
because of it: (the checkpoint + one iteration) - (an iteration without checkpoint, the median
of --baseline iterations before it), the slowest rank's. Before the next checkpoint the upload
is waited for (not counted), so that each checkpoint starts alike. Variants:

  none             no checkpoint: the iteration alone, measured as one after a checkpoint is,
                   against the same baseline. Its stall_s is the noise of the measurement (how
                   far one iteration strays from a median of others), to read the variants'
                   stall_s against

  async_save       dcp.async_save with its own stager (it stages the whole state dict before
                   it returns)
  default_stager   torch's DefaultStager, a new one per checkpoint (closed once its upload is
                   done), the model state left on the GPU for it; staging_completion is waited
                   for before optimizer.step(). Its options (the rows' staging_options):
                   --default-stager-options automodel: DefaultStager() as NeMo Automodel makes
                   it, torch's defaults StagingOptions() (pinned memory, shared memory,
                   asynchronous staging, non-blocking copies); unshared (the default, what this
                   variant measured before the option): the same without shared memory;
                   unpinned: the same as automodel without pinned memory; plain: neither
                   pinned nor shared memory
  default_stager_reused  the same with one DefaultStager for all the variant's checkpoints
                   (closed after the last), to see whether one can stage twice. torch 2.11's
                   cannot: DefaultStager._stage() closes its StateDictStager after each
                   staging (torch/distributed/checkpoint/staging.py:251-253), and
                   StateDictStager.close() empties the deep-copy dispatch table as well as its
                   cache of staged storages (_state_dict_stager.py:273-274), so the second
                   staging looks up `type` in an empty table: KeyError(<class 'type'>)
                   (_state_dict_stager.py:319) in the staging thread, the row's error.
                   async_save closes no stager passed to it (in 2.11 none at all; torch 2.13
                   closes only one it made itself, and its _stage() no longer closes, so that a
                   reused one stages again, into the storages it cached). Each staging of 2.11
                   makes new storages (pinned; in shared memory with automodel): a reused
                   stager would not keep them for the next checkpoint either
  te_stager        te_fusedadam_offload.staging.CheckpointStager (one, reused): the model's GPU
                   tensors into its pinned buffers, the export's private CPU tensors passed
                   through (stager.optimizer_export())
  te_stager_async  the same with async_staging=True: the model copies overlap forward and
                   backward; staging_completion before optimizer.step()
  te_snapshot      CheckpointStager(async_staging=True) with stager.optimizer_snapshot() in
                   place of the export: the stager copies the optimizer states into pinned
                   buffers it keeps, beside forward and backward; optimizer.step() waits on
                   the GPU for the copies (no wait for staging_completion before it). Its
                   export_optim_s is only the call that makes the snapshot object: the
                   copies are enqueued in async_save (async_save_s)
  torch_checkpointing  torch_checkpointing's CheckpointManager (asynchronous saver, its own
                   staging of the model; one manager, reused; no O_DIRECT; a path per
                   checkpoint), the export as an item with ItemSpec(requires_copy=False);
                   optimizer.step() once manager.lock() is free (as `with manager.lock():
                   optimizer.step()` waits); not with --write-delay-s or --overlap

The upload: --checkpointer thread (the default) has dcp.async_save upload in a thread of the
training process; --checkpointer process passes it
async_checkpointer_type=AsyncCheckpointerType.PROCESS, as NeMo Automodel does. Then torch
starts one background process per rank, at the first async_save of the run, and keeps it for
the later ones (torch 2.11's _async_process_executor.py:354-455): the ranks agree on its
address with a broadcast in that async_save, then an upload thread spawns it (it imports this
script again, as __mp_main__: main() stays under the `if __name__ == "__main__":` guard) and
waits until it has joined a gloo group of its own; each upload sends the staged state dict to
it through a pipe, which first moves a CPU tensor that is not in shared memory into shared
memory (torch.multiprocessing's reduce_storage: a copy, and the staged tensor is then that
shared memory). The start is paid by the run's first checkpoint, as a user pays it, and by no
later one (checkpointer_started is true on that row): to see it on each mode's first row, run
one mode per torchrun. Not with --overlap (torch's background process takes one upload at a
time through its one pipe), the te_ variants (the move into shared memory would take the
stager's pinned buffers from it) or torch_checkpointing (no dcp.async_save).

A checkpoint that raises on a rank, in its export, async_save, the staging or the upload: a
staging's error comes from staging_completion before optimizer.step() (that step is then
skipped), or from upload_completion only, where the staging had failed before async_save looked
at it (torch's staging_completion then reports success: state_dict_saver.py:354-357 in 2.11).
The ranks agree on it after the iteration (an all-reduce, outside the times) and, while the
uploads run, every 50 ms, so that no rank waits for an upload that waits in a collective for a
rank that failed; every rank skips the variant's later checkpoints (with --overlap, the failure
of an upload is found once the later ones are taken), and the run goes on with the next
variant, whose uploads get a process group of their own. The checkpoint's row has error, the
first failing rank's exception ("rank R: KeyError(<class 'type'>)"), and no times or memory
figures; every other row has error null. With --checkpointer process, torch's background
processes keep a group of their own: where only some ranks failed, a background process may
still wait in that checkpoint's collectives, and later uploads of the run may fail (their rows
say so). A rank that fails inside a collective of the training process (the export's) leaves
the others waiting, as in training.

A slow storage and checkpoints that overlap: --write-delay-s S makes each upload wait S
seconds before it writes (tests/staging/slow_storage.py's SlowWriter, as a busy or remote file
system), and --overlap starts each checkpoint without waiting for the previous upload (each
upload with a process group of its own, since DCP runs overlapping uploads at once), so that
a checkpoint's staging finds the previous upload still writing: CheckpointStager then gives it
new pinned buffers (overlapping_stagings counts them), whose cost this measures:

  torchrun --nproc_per_node=1 benchmark_checkpoint_stall.py --modes offload \
      --variants te_stager te_stager_async --write-delay-s 10 [--overlap] --out stall.jsonl

One JSON line per checkpoint (rank 0): variant, offload, store_param_remainders, checkpointer
("thread"/"process"; null for none and torch_checkpointing), checkpointer_started,
staging_options (the DefaultStager's StagingOptions as a dict; null for the other variants),
error, iteration ("short"/"long"), n (the checkpoint's index), overlap, write_delay_s,
torch_threads (PyTorch's intra-op threads, on which te_snapshot's BF16 widening runs) and
omp_num_threads (the variable that sets them), alloc_conf (PYTORCH_CUDA_ALLOC_CONF:
pinned_use_cuda_host_register speeds up the pinning), iteration_s (the baseline's median;
iteration_min_s and iteration_max_s its shortest and longest, the noise that a single iteration
after the checkpoint carries), returned_s (until async_save returned), stall_s, and where the
time went: export_optim_s, export_model_s, async_save_s, wait_staging_s (in the next iteration,
before step()), uploaded_s (from the start until the upload is done); host memory of the rank
(rss_gib: after the upload, with the state dict dropped, or with --overlap after the iteration;
rss_peak_gib: the process's peak so far), the stager's pinned buffers (pinned_gib: those it
keeps for the next checkpoint; null for the variants without a CheckpointStager) and, for the
te_stager variants, overlapping_stagings (so far) and uploads_pending (uploads not done when
this checkpoint started). With --overlap the rows are written once every upload is done.

The stager and memory of each row (memory: the largest of the ranks' figures): stager, the
class of the stager that the variant passes to async_save (DefaultStager, CheckpointStager;
CheckpointManager for torch_checkpointing; null for none, and for async_save, which makes its
own DefaultStager(StagingOptions(False, False, False, False))); gpu_peak_gib, the most GPU
memory allocated above what was allocated at the checkpoint's start, until async_save returned
(torch.cuda.max_memory_allocated() after torch.cuda.reset_peak_memory_stats() at the start: the
export's and a synchronous staging's; not the iteration after, whose gradients it would count);
pinned_bytes, the most pinned host memory that PyTorch's host allocator held from the start
until the upload was done (torch.cuda.host_memory_stats()["allocated_bytes.peak"] after
torch.cuda.reset_peak_host_memory_stats() at the start: its blocks in use and cached, each
rounded up to a power of two; CheckpointStager's buffers are there; null without those
functions). DefaultStager pins its storages with cudaHostRegister
(torch.cuda._pin_memory_utils), outside that allocator: staged_pinned_bytes and
staged_shared_bytes are the bytes of the staged state dict's CPU storages (each counted once)
that are pinned and that are in shared memory, read once the upload is done (when the pipe to a
background process has moved any into shared memory), for the DefaultStager variants (null for
the others). shm_bytes: the most bytes in use on the /dev/shm file system above its use at the
start, from os.statvfs (the whole machine's: a background process's shared memory too, and the
checkpoint's files where --ckpt-dir is under /dev/shm), sampled every 20 ms until the upload
was done (torch's shared memory files are unlinked as soon as made, torch.multiprocessing's
file_descriptor strategy, and cannot be listed); shm_after_bytes, the same at rss_gib's moment:
what the checkpoint left in use. A DefaultStager holds its last staged state dict (its
_staging_future) until it is dropped, close() or not: default_stager drops its stager before
rss_gib, default_stager_reused keeps it; torch 2.11's background process holds the last request
it received, its staged state dict, until the next one arrives
(_async_process_executor.py:290-326).

What the upload costs the iterations after that one (the stall counts only the first):
--train-during-upload goes on training until every rank's upload is done, and adds
after_iterations (how many), after_s (their seconds) and after_excess_s (after_s minus as many
iterations of the baseline's median; it also holds what te_snapshot's BF16 widening, before
the upload, takes from them) to the rows. after_excess_s / after_iterations is the cost per
iteration, to be read against the spread of the baseline.

The first checkpoint's pinned buffers made beforehand: --prepare has each te_ variant's stager
make them with stager.prepare() (of the state dict that async_save then gets, in a background
thread) after the warm-up, and go on training until every rank's prepare() is done; every row
of the variant gets prepared (true; false without the flag or for the other variants) and the
prepare's figures (the same on each row): prepare_returned_s (until prepare() returned, the
state dict made), prepare_s (until its buffers were made), prepare_iterations (the iterations
meanwhile), prepare_excess_s (their seconds minus as many medians of --baseline iterations
before it: what the allocation took from training) and prepare_gib (pinned memory it made).
"""

import argparse
import dataclasses
import functools
import gc
import os
import shutil
import statistics
import sys
import threading
import time
import weakref
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

import transformer_engine

from te_fusedadam_offload.staging import CheckpointStager

# The model, the optimizer and the helpers of the DCP benchmark beside this one (run as a
# script, this folder is on sys.path).
from benchmark_dcp_checkpoint import GiB, _build, _checkpoint_dir, _emit, _max_over_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "staging"))
from slow_storage import SlowWriter  # pylint: disable=wrong-import-position,wrong-import-order

OFFLOAD = StateDictOptions(cpu_offload=True)
VARIANTS = (
    "none",
    "async_save",
    "default_stager",
    "default_stager_reused",
    "te_stager",
    "te_stager_async",
    "te_snapshot",
    "torch_checkpointing",
)
NO_ASYNC_SAVE = ("none", "torch_checkpointing")  # the variants that do not call dcp.async_save
CHECKPOINTERS = {"thread": AsyncCheckpointerType.THREAD, "process": AsyncCheckpointerType.PROCESS}


def _shm_used():
    """Bytes in use on the /dev/shm file system (the whole machine's), or None without it."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return (st.f_blocks - st.f_bfree) * st.f_frsize


class Memory:
    """A checkpoint's memory figures from its start (see the module's docstring): /dev/shm
    sampled in a thread until stop()."""

    def __init__(self):
        torch.cuda.reset_peak_memory_stats()
        self.gpu_before = torch.cuda.memory_allocated()
        self.host_stats = (  # PyTorch's host allocator's (not in a build without CUDA)
            torch.cuda.is_available()
            and hasattr(torch.cuda, "host_memory_stats")
            and hasattr(torch.cuda, "reset_peak_host_memory_stats")
        )
        if self.host_stats:
            torch.cuda.reset_peak_host_memory_stats()
        self.shm_start = self.shm_peak = _shm_used()
        self.stopped = threading.Event()
        self.poller = threading.Thread(target=self._poll, daemon=True)
        if self.shm_start is not None:
            self.poller.start()

    def _poll(self):
        while not self.stopped.wait(0.02):
            self.shm_peak = max(self.shm_peak, _shm_used())

    def stop(self):
        """Stop sampling /dev/shm (again: nothing)."""
        self.stopped.set()
        if self.poller.is_alive():
            self.poller.join()

    def returned(self, row):
        """At async_save's return: gpu_peak_gib."""
        row["gpu_peak_gib"] = (torch.cuda.max_memory_allocated() - self.gpu_before) / GiB

    def uploaded(self, row, stager):
        """Once the upload is done: shm_bytes, pinned_bytes and the staged state dict's (each
        None until found: a row has them all, whatever fails)."""
        for key in ("shm_bytes", "pinned_bytes", "staged_pinned_bytes", "staged_shared_bytes"):
            row[key] = None
        self.stop()
        if self.shm_start is not None:
            row["shm_bytes"] = max(self.shm_peak, _shm_used()) - self.shm_start
        stats = torch.cuda.host_memory_stats() if self.host_stats else {}
        row["pinned_bytes"] = stats.get("allocated_bytes.peak")
        row["staged_pinned_bytes"], row["staged_shared_bytes"] = _staged_bytes(stager)

    def after(self, row):
        """At rss_gib's moment: shm_after_bytes."""
        used = _shm_used()
        row["shm_after_bytes"] = None if used is None else used - self.shm_start


def _staged_bytes(stager):
    """Bytes of the CPU storages (each once) of a DefaultStager's last staged state dict that
    are pinned and that are in shared memory; (None, None) for another stager or none."""
    future = getattr(stager, "_staging_future", None)  # DefaultStager's, with its result
    if not isinstance(future, Future) or not future.done() or future.exception() is not None:
        return None, None
    pinned = shared = 0
    seen = set()
    todo = [future.result()]
    while todo:
        value = todo.pop()
        if isinstance(value, dict):
            todo.extend(value.values())
        elif isinstance(value, (list, tuple)):
            todo.extend(value)
        elif isinstance(value, torch.Tensor):
            local = getattr(value, "_local_tensor", value)  # a DTensor's shard
            storage = local.untyped_storage()
            if local.device.type != "cpu" or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            pinned += storage.nbytes() if local.is_pinned() else 0
            shared += storage.nbytes() if local.is_shared() else 0
    return pinned, shared


def _rss_gib():
    """Resident and peak resident memory of this process (GiB), from /proc."""
    found = {}
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                found[key] = int(value.split()[0]) * 1024 / GiB
    return found["VmRSS"], found["VmHWM"]


class CheckpointFailed(Exception):
    """A checkpoint that raised on some rank; every rank raises this, with that rank's error."""


class Trainer:
    """Iterations of a fixed length, with a hook before optimizer.step()."""

    def __init__(self, model, optimizer, width, batch, microbatches):
        self.model, self.optimizer = model, optimizer
        self.x = torch.randn(batch, width, device="cuda", dtype=torch.bfloat16)
        self.microbatches = microbatches

    def iteration(self, before_step=None):
        """One iteration; returns the seconds that `before_step` took."""
        for _ in range(self.microbatches):
            self.model(self.x).float().square().mean().backward()
        waited = 0.0
        if before_step is not None:
            start = time.perf_counter()
            before_step()
            waited = time.perf_counter() - start
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return waited

    def until(self, future, before_step=None):
        """Iterations until `future` is done on every rank (or has failed on one): how many,
        and their seconds."""
        count, seconds = 0, 0.0
        while _pending_on_every_rank(future):
            start = time.perf_counter()
            self.iteration(before_step)
            seconds += time.perf_counter() - start
            count += 1
        return count, seconds

    def baseline(self, count):
        """Seconds of `count` iterations (slowest rank): median, shortest, longest."""
        times = []
        for _ in range(count):
            dist.barrier()
            start = time.perf_counter()
            self.iteration()
            times.append(_max_over_ranks(time.perf_counter() - start))
        return statistics.median(times), min(times), max(times)


def checkpoint(variant, trainer, state_stager, group, path, args, iteration_s):
    """One checkpoint and the iteration after it (with --train-during-upload, and the
    iterations until every rank's upload is done, against `iteration_s` each): the row's times
    (this rank's), the upload (done unless --overlap) and an event set once the times have its
    uploaded_s."""
    row = {}
    torch.cuda.synchronize()
    dist.barrier()
    memory = Memory()
    start = time.perf_counter()
    if variant == "none":  # the control: an iteration without checkpoint, timed alike
        row["returned_s"] = 0.0
        memory.returned(row)
        row["wait_staging_s"] = trainer.iteration()
        row["total_s"] = time.perf_counter() - start
        memory.uploaded(row, None)
        row["rss_gib"], row["rss_peak_gib"] = _rss_gib()
        memory.after(row)
        nothing, written = Future(), threading.Event()
        nothing.set_result(None)
        written.set()
        return row, nothing, written
    stager = _default_stager(args) if variant == "default_stager" else state_stager
    error = None
    try:
        upload, uploaded, before_step = _start(
            variant, trainer, stager, group, path, args, row, start, memory
        )
        row["wait_staging_s"] = trainer.iteration(before_step)
    except Exception as exc:  # pylint: disable=broad-exception-caught
        error = exc
        trainer.optimizer.zero_grad(set_to_none=True)  # the step that the error skipped
        memory.stop()
    row["total_s"] = time.perf_counter() - start
    failed = _failed_on_a_rank(error)
    if failed is None and args.train_during_upload:  # until every rank's upload is done
        row["after_iterations"], row["after_s"] = trainer.until(upload, before_step)
        row["after_excess_s"] = row["after_s"] - row["after_iterations"] * iteration_s
    if failed is None and not args.overlap:
        failed = _wait_on_every_rank(upload)
        if failed is None:
            uploaded.wait()  # its callback has read the figures of the upload's end
    if failed is not None:
        if variant == "default_stager":
            stager.close()
        raise CheckpointFailed(failed)
    if variant == "default_stager":
        if args.overlap:  # closed once its upload is done
            upload.add_done_callback(lambda _: stager.close())
        else:
            stager.close()
            stager = None  # and dropped, with its last staged state dict, before rss_gib
    gc.collect()
    row["rss_gib"], row["rss_peak_gib"] = _rss_gib()
    memory.after(row)
    return row, upload, uploaded


def _start(variant, trainer, stager, group, path, args, row, start, memory):
    """The export and async_save of a checkpoint that started at time.perf_counter() `start`,
    their times and `memory`'s figures into `row`: the upload, an event set once `row` has
    uploaded_s and the figures of the upload's end, and what the iteration after it waits for
    before optimizer.step() (or None)."""
    model, optimizer = trainer.model, trainer.optimizer
    optim = _optim_state(variant, stager, model, optimizer)
    row["export_optim_s"] = time.perf_counter() - start
    mark = time.perf_counter()
    on_gpu = variant != "async_save"
    state = {
        "model": get_model_state_dict(model, options=StateDictOptions() if on_gpu else OFFLOAD),
        "optim": optim,
    }
    row["export_model_s"] = time.perf_counter() - mark
    mark = time.perf_counter()
    where = {"checkpoint_id": path}
    if args.write_delay_s:
        where = {"storage_writer": SlowWriter(path, args.write_delay_s)}
    if variant == "torch_checkpointing":
        result = stager.save(path, state)  # the manager; its write future
    else:
        result = dcp.async_save(
            state,
            process_group=group,
            async_stager=stager,
            async_checkpointer_type=CHECKPOINTERS[args.checkpointer],
            **where,
        )
    row["async_save_s"] = time.perf_counter() - mark
    row["returned_s"] = time.perf_counter() - start
    memory.returned(row)
    del state, optim
    staging = getattr(result, "staging_completion", None)
    upload = getattr(result, "upload_completion", result)
    before_step = staging.result if staging is not None else None
    if variant == "te_snapshot":
        before_step = None  # optimizer.step() waits on the GPU for the snapshot's copies
    elif variant == "torch_checkpointing":
        before_step = functools.partial(_wait_for_lock, stager)
    uploaded = threading.Event()  # set once row["uploaded_s"] is
    # Not a reference from the upload's callbacks: the stager holds its last staged state dict
    ref = None if stager is None else weakref.ref(stager)

    def _uploaded(_):
        row["uploaded_s"] = time.perf_counter() - start
        try:
            memory.uploaded(row, None if ref is None else ref())
        finally:
            uploaded.set()

    upload.add_done_callback(_uploaded)
    return upload, uploaded, before_step


def _max_bytes_over_ranks(value):
    """The largest of the ranks' byte counts (exact), None where every rank has None."""
    none = torch.iinfo(torch.int64).min
    t = torch.tensor([none if value is None else value], dtype=torch.int64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return None if t.item() == none else t.item()


def _wait_on_every_rank(upload):
    """Wait until `upload` is done on every rank, or has failed on one (not then for a rank
    whose upload waits in a collective for the failed one); what _failed_on_a_rank gives."""
    while _pending_on_every_rank(upload):
        time.sleep(0.05)
    return _failed_on_a_rank(upload.exception() if upload.done() else None)


def _pending_on_every_rank(future):
    """Whether `future` is not done on some rank and has failed on none (one all-reduce)."""
    done = future.done()
    flags = torch.tensor(
        [float(done and future.exception() is not None), float(not done)], device="cuda"
    )
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return not flags[0].item() and bool(flags[1].item())


def _failed_on_a_rank(error):
    """None if no rank's checkpoint raised (`error`: this rank's exception or None), else the
    first failing rank's error as "rank R: repr", the same on every rank."""
    if not _max_over_ranks(error is not None):
        return None
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, None if error is None else repr(error))
    return next(f"rank {rank}: {text}" for rank, text in enumerate(errors) if text is not None)


def _optim_state(variant, state_stager, model, optimizer):
    """The optimizer part of the state dict that a variant passes to async_save."""
    if variant == "te_snapshot":
        return state_stager.optimizer_snapshot(model, optimizer)  # taken in async_save
    if variant.startswith("te_") and hasattr(state_stager, "optimizer_export"):
        # The export's private CPU copies passed through (a stager from before
        # optimizer_export() passed every CPU tensor through)
        return state_stager.optimizer_export(model, optimizer, options=OFFLOAD)
    return get_optimizer_state_dict(model, optimizer, options=OFFLOAD)


def prepare(variant, trainer, stager, args):
    """--prepare: stager.prepare() of the state dict that the variant's checkpoints pass to
    async_save, then iterations until every rank's buffers are made; the rows' figures."""
    iteration_s, _, _ = trainer.baseline(args.baseline)
    model, optimizer = trainer.model, trainer.optimizer
    torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    state = {  # the model state on the GPU, as in checkpoint() for the te_ variants
        "model": get_model_state_dict(model),
        "optim": _optim_state(variant, stager, model, optimizer),
    }
    future = stager.prepare(state)
    returned = time.perf_counter() - start
    del state
    ended = []
    future.add_done_callback(lambda _: ended.append(time.perf_counter()))
    iterations, spent = trainer.until(future)
    made = future.result()
    # Its callback runs just after the future is done: a moment later at most.
    prepare_s = (ended[0] if ended else time.perf_counter()) - start
    return {
        "prepare_returned_s": round(_max_over_ranks(returned), 4),
        "prepare_s": round(_max_over_ranks(prepare_s), 4),
        "prepare_iterations": iterations,
        "prepare_excess_s": round(_max_over_ranks(spent - iterations * iteration_s), 4),
        "prepare_gib": round(_max_over_ranks(made) / GiB, 3),
    }


def _starts_checkpointer(args, variant):
    """Whether the variant's next checkpoint starts torch's background process of
    --checkpointer process (none runs yet: the run's first async_save)."""
    if args.checkpointer != "process" or variant in NO_ASYNC_SAVE:
        return False
    # pylint: disable-next=import-outside-toplevel
    from torch.distributed.checkpoint import _async_process_executor

    return _async_process_executor._CHECKPOINT_PROCESS is None  # pylint: disable=protected-access


def _wait_for_lock(manager):
    """What `with manager.lock(): optimizer.step()` waits for before the step."""
    with manager.lock():
        pass


def _staging_options(args):
    """The StagingOptions of the default_stager variants' DefaultStager."""
    # pylint: disable-next=import-outside-toplevel
    from torch.distributed.checkpoint.staging import StagingOptions

    if args.default_stager_options == "automodel":
        return StagingOptions()  # torch's defaults, those of DefaultStager()
    return StagingOptions(
        use_pinned_memory=args.default_stager_options == "unshared",
        use_shared_memory=args.default_stager_options == "unpinned",  # plain: neither
        use_async_staging=True,
        use_non_blocking_copy=True,
    )


def _default_stager(args):
    """A DefaultStager with the --default-stager-options."""
    # pylint: disable-next=import-outside-toplevel
    from torch.distributed.checkpoint.staging import DefaultStager

    return DefaultStager(_staging_options(args))


def _stager(variant, args):
    """The stager (or torch_checkpointing's manager) a variant reuses, or None."""
    if variant == "torch_checkpointing":
        from torch_checkpointing import (  # pylint: disable=import-outside-toplevel
            CheckpointManager,
            ItemSpec,
        )

        from torch_checkpointing.storage.filesystem import (  # pylint: disable=import-outside-toplevel
            LocalFileSystemStorageConfig,
        )

        items = {"model": ItemSpec(), "optim": ItemSpec(requires_copy=False)}
        # Without O_DIRECT: unaligned writes failed with EINVAL on the H200 machine's /dev/shm.
        storage = LocalFileSystemStorageConfig(use_direct_io=False)
        return CheckpointManager(CheckpointManager.Config(items=items, storage_config=storage))
    if variant.startswith("te_"):
        return CheckpointStager(async_staging=variant != "te_stager")
    if variant == "default_stager_reused":
        return _default_stager(args)
    return None


def run(args, base, offload):
    """Every variant and iteration length for one mode."""
    model, optimizer, width = _build(args, offload)
    group = dist.new_group(backend="gloo")  # async_save's collectives run in its own thread
    lengths = {"short": (args.batch, 1), "long": (args.long_batch, args.long_microbatches)}
    for variant in args.variants:
        for length in args.iterations:
            trainer = Trainer(model, optimizer, width, *lengths[length])
            trainer.baseline(args.warmup)
            stager = _stager(variant, args)
            te_stager = isinstance(stager, CheckpointStager)
            prepared = {"prepared": bool(args.prepare and te_stager)}
            if prepared["prepared"]:
                prepared.update(prepare(variant, trainer, stager, args))
            path = _checkpoint_dir(args, f"stall-{variant}")
            pending = []  # (row, this rank's times, (upload, event)) not yet written
            for n in range(args.checkpoints):
                iteration_s, shortest, longest = trainer.baseline(args.baseline)
                row = dict(
                    base,
                    variant=variant,
                    offload=offload,
                    stager=(
                        "DefaultStager"
                        if variant == "default_stager"  # a new one per checkpoint
                        else None if stager is None else type(stager).__name__
                    ),
                    checkpointer=None if variant in NO_ASYNC_SAVE else args.checkpointer,
                    checkpointer_started=_starts_checkpointer(args, variant),
                    staging_options=(
                        dataclasses.asdict(_staging_options(args))
                        if variant.startswith("default_stager")
                        else None
                    ),
                    error=None,
                    iteration=length,
                    n=n,
                    overlap=args.overlap,
                    write_delay_s=args.write_delay_s,
                    iteration_s=round(iteration_s, 4),
                    iteration_min_s=round(shortest, 4),
                    iteration_max_s=round(longest, 4),
                    **prepared,
                )
                if te_stager:
                    row["uploads_pending"] = sum(not u.done() for _, _, (u, _) in pending)
                if args.overlap:  # a group per upload: overlapping uploads run at once
                    group = dist.new_group(backend="gloo")
                # torch_checkpointing does not overwrite a checkpoint: one path per checkpoint.
                fresh = args.overlap or variant == "torch_checkpointing"
                checkpoint_path = f"{path}-{n}" if fresh else path
                try:
                    times, *upload = checkpoint(
                        variant, trainer, stager, group, checkpoint_path, args, iteration_s
                    )
                except CheckpointFailed as exc:  # on every rank: the variant stops here
                    _write_rows(args, pending)
                    _emit(args, dict(row, error=str(exc)))
                    # An upload of a rank that did not fail may still wait in the old group.
                    group = dist.new_group(backend="gloo")
                    break
                row["pinned_gib"] = round(stager.cached_bytes() / GiB, 3) if te_stager else None
                if te_stager:
                    row["overlapping_stagings"] = stager.overlapping_stagings
                pending.append((row, times, upload))
                if not args.overlap:
                    _write_rows(args, pending)
            _write_rows(args, pending)
            if stager is not None:
                stager.close()
                gc.collect()
                if dist.get_rank() == 0:  # the host memory given back by close()
                    print(f"# {variant} {length}: closed, rss_gib {_rss_gib()[0]:.3f}", flush=True)
            if dist.get_rank() == 0:
                shutil.rmtree(path, ignore_errors=True)
                for n in range(args.checkpoints):
                    shutil.rmtree(f"{path}-{n}", ignore_errors=True)
            dist.barrier()


def _write_rows(args, pending):
    """Wait for the uploads of `pending` ([(row, this rank's times, (upload, its event))]),
    then write their rows (times: the slowest rank's; an upload that failed on a rank: its
    error) and empty it."""
    for row, times, (upload, uploaded) in pending:
        failed = _wait_on_every_rank(upload)
        if failed is not None:  # with --overlap (else checkpoint() raised CheckpointFailed)
            _emit(args, dict(row, error=failed))
            continue
        uploaded.wait()
        # In one order on every rank: a rank's upload may set uploaded_s before its iteration
        # has set total_s.
        for key in sorted(times):
            if key.endswith("_bytes"):  # integers, or None
                row[key] = _max_bytes_over_ranks(times[key])
            else:
                row[key] = round(_max_over_ranks(times[key]), 4)
        row["stall_s"] = round(row["total_s"] - row["iteration_s"], 4)
        if "after_iterations" in row:
            row["after_iterations"] = int(row["after_iterations"])
        _emit(args, row)
    pending.clear()


def main():
    """Parse arguments, run the modes under torchrun, write the rows."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    parser.add_argument("--local-log2", type=int, default=29, help="parameter elements per rank")
    parser.add_argument("--largest-log2", type=int, default=24, help="elements per layer (even)")
    parser.add_argument("--checkpoints", type=int, default=3, help="consecutive checkpoints")
    parser.add_argument("--modes", nargs="+", default=["default", "offload"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--iterations", nargs="+", default=["short", "long"])
    parser.add_argument("--batch", type=int, default=8, help="rows of the short iteration")
    parser.add_argument("--long-batch", type=int, default=8192)
    parser.add_argument("--long-microbatches", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--baseline", type=int, default=3)
    parser.add_argument("--ckpt-dir", default="/tmp/te_checkpoint_stall")
    parser.add_argument(
        "--write-delay-s",
        type=float,
        default=0.0,
        help="each upload waits this long before it writes (a slow storage)",
    )
    parser.add_argument(
        "--overlap",
        action="store_true",
        help="start each checkpoint without waiting for the previous upload",
    )
    parser.add_argument(
        "--train-during-upload",
        action="store_true",
        help="after the iteration of the stall, go on training until every rank's upload is done",
    )
    parser.add_argument(
        "--prepare",
        action="store_true",
        help="te_ variants: stager.prepare() before the first checkpoint, training until done",
    )
    parser.add_argument(
        "--store-param-remainders",
        action="store_true",
        help="FusedAdam(store_param_remainders=True): int16 remainders as the master weights",
    )
    parser.add_argument(
        "--default-stager-options",
        choices=["automodel", "unshared", "unpinned", "plain"],
        default="unshared",
        help=(
            "default_stager variants: DefaultStager() (pinned, shared memory), unshared or"
            " unpinned (shared memory, not pinned) or plain (neither)"
        ),
    )
    parser.add_argument(
        "--checkpointer",
        choices=list(CHECKPOINTERS),
        default="thread",
        help="dcp.async_save's async_checkpointer_type: upload in a thread or a background process",
    )
    parser.add_argument("--out", help="append the JSON lines to this file")
    args = parser.parse_args()
    if args.baseline < 1 or args.warmup < 1:
        parser.error("--baseline and --warmup take at least one iteration")
    if args.train_during_upload and args.overlap:
        parser.error("--train-during-upload waits for each upload; --overlap does not")
    if "torch_checkpointing" in args.variants and (args.write_delay_s or args.overlap):
        parser.error("torch_checkpointing runs without --write-delay-s and --overlap")
    if args.checkpointer == "process":
        if args.overlap:
            parser.error(
                "--checkpointer process takes one upload at a time; --overlap overlaps them"
            )
        refused = [v for v in args.variants if v.startswith("te_") or v == "torch_checkpointing"]
        if refused:
            parser.error(f"--checkpointer process is for torch's stagers, not {' '.join(refused)}")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend="cpu:gloo,cuda:nccl")
    base = {
        "world_size": dist.get_world_size(),
        "local_log2": args.local_log2,
        "store_param_remainders": args.store_param_remainders,
        "gpu": torch.cuda.get_device_name(),
        "cpus": os.cpu_count(),
        # PyTorch's intra-op threads, on which te_snapshot's BF16 widening runs
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS", ""),
        # PyTorch's pinned allocation (pinned_use_cuda_host_register): the first checkpoint's
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "torch": torch.__version__,
        "te": transformer_engine.__version__,
    }
    try:
        for mode in args.modes:
            run(args, base, mode == "offload")
            torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
