"""A stager for ``torch.distributed.checkpoint.async_save`` that does not copy what is a copy.

``dcp.async_save`` stages (copies) the whole state dict before it writes it, in the training
thread unless a stager does it elsewhere. With ``FusedAdam(state_dict_cpu_offload=True)`` the
optimizer part of the state dict is already a private CPU copy (bitwise the default export),
and copying it again is most of the checkpoint stall (6.4 GB per rank at 2^29 parameter
elements with BF16 moments and FP32 master weights). :class:`CheckpointStager` copies only the
GPU tensors (the model's parameters and buffers, which training changes) into pinned CPU
buffers that it keeps for the next checkpoint, and passes CPU tensors through as they are (a
fragment: DCP's imports, ``model``, ``optimizer``, ``path`` and the options are the caller's)::

    from te_fusedadam_offload.staging import CheckpointStager

    stager = CheckpointStager()  # once; reused for every checkpoint
    state = {
        "model": get_model_state_dict(model),  # GPU: copied into the stager's pinned buffers
        "optim": get_optimizer_state_dict(model, optimizer, options=cpu_offload_options),
    }
    upload = dcp.async_save(state, checkpoint_id=path, async_stager=stager,
                            process_group=checkpoint_group)
    ...  # training goes on; the staged model part is a copy
    upload.result()  # before the next checkpoint, as DCP's collectives need
    stager.close()  # at the end

Without the export's wait: ``stager.optimizer_snapshot(model, optimizer)`` in place of
``get_optimizer_state_dict(...)`` has the stager copy the optimizer states themselves into
pinned buffers that it keeps, on its side stream, and ``optimizer.step()`` wait on the GPU for
those copies; with ``CheckpointStager(async_staging=True)`` the checkpoint then costs training
only what of the copies forward and backward do not cover.

This module is a runtime helper of this patch set, not TE code. It implements DCP's public
``AsyncStager`` protocol; of DTensor it uses the local tensor and the spec, as DCP's own
state-dict utilities and ``DTensor.to()`` do, to wrap a CPU copy of a GPU DTensor's shard.
"""

import copy
import dataclasses
import functools
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

try:
    import torch
    from torch.distributed.checkpoint.staging import AsyncStager
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.tensor import DTensor
except ImportError as exc:  # pragma: no cover (the message is tested in a torch-less process)
    raise ImportError(
        "te_fusedadam_offload.staging needs PyTorch with torch.distributed.checkpoint's "
        f"AsyncStager and DTensor ({exc}); install torch (the extra 'staging' of this package "
        "declares it: pip install '<its checkout>[staging]')"
    ) from exc

__all__ = ["CheckpointStager"]


class CheckpointStager(AsyncStager):
    """Stage a state dict for ``dcp.async_save`` (pass it as ``async_stager``).

    GPU tensors (also the local shards of DTensors; those of one CUDA device) are copied into
    pinned CPU tensors that the stager allocates at the first checkpoint and reuses for every
    later one with the same keys, shapes and dtypes (a changed one is reallocated, one no
    longer in the state dict freed); DTensors keep their mesh,
    placements, shape and stride. CPU tensors are passed through without a copy: put only CPU
    tensors in the state dict that nothing changes until the checkpoint is written, such as
    the export of ``FusedAdam(state_dict_cpu_offload=True)`` or a ``cpu_offload=True`` model
    state dict. Other values (ints, floats, strings, lists of them) are deep-copied.

    Arguments:
        async_staging (bool, optional): with False (default), ``stage()`` returns when the
            copies are done, and ``dcp.async_save`` returns a future of the upload: training
            may change the model at once. With True, ``stage()`` only enqueues the copies on a
            side CUDA stream and returns a future; ``dcp.async_save`` returns an
            ``AsyncSaveResponse``, and forward and backward can run while the copies are made,
            but nothing may change the model's tensors (``optimizer.step()``, loads, in-place
            updates) before ``response.staging_completion.result()`` returns; with an
            :meth:`optimizer_snapshot` in the state dict, that optimizer's ``step()`` waits on
            the GPU by itself instead (the rest still waits for ``staging_completion``).

    Checkpoints that overlap: a buffer is reused only when nothing holds what the last
    staging made of it, that is when the upload that wrote it is done (DCP drops the staged
    state dict then). A ``dcp.async_save`` that starts before the previous upload is done gets
    new pinned buffers for the tensors whose buffers are still being written: training is not
    held up and no checkpoint is overwritten, at the cost of one more copy of the model's
    tensors in pinned host memory until that upload is done (a failed upload's future holds
    them as long as it is kept). ``overlapping_stagings`` counts such stagings. DCP itself
    does not order overlapping uploads (each ``async_save`` starts its own upload thread on the
    process group it is given), so waiting for the previous upload before the next checkpoint
    remains the way to keep one upload at a time. ``stage()`` raises a RuntimeError if the
    previous *staging* (``async_staging=True``) is not complete.

    The optimizer part can be a snapshot that the stager takes (:meth:`optimizer_snapshot`)
    instead of the export: no ``state_dict_cpu_offload`` wait, the states copied into pinned
    buffers kept like the model's. :meth:`close` frees the buffers and empties PyTorch's cache
    of pinned memory, giving the host memory back.
    """

    def __init__(self, *, async_staging=False):
        self._async = async_staging
        # path in the state dict -> (pinned CPU tensor, weak reference to the view of it that
        # the last staging returned: alive while its upload holds the staged state dict)
        self._cache = {}
        self.overlapping_stagings = 0  # stagings that got new buffers: the old ones in use
        self._stream = None
        self._executor = ThreadPoolExecutor(max_workers=1) if async_staging else None
        # Set while no staging is under way. Not the future itself: that holds the staged
        # state dict (the export too) until the next checkpoint.
        self._idle = threading.Event()
        self._idle.set()
        self._lock = threading.Lock()
        self._closed = False
        # optimizer -> the handle of its step pre-hook (optimizer_snapshot()); neither keeps
        # the other alive
        self._hooks = weakref.WeakKeyDictionary()
        self._snapshot_event = None  # (device, event) of the last snapshot's copies, until done

    @property
    def should_synchronize_after_execute(self):
        """Staging is complete when stage() returns, or when its future is done."""
        return False

    def stage(self, state_dict):
        """The state dict with GPU tensors copied to the reused pinned buffers, optimizer
        snapshots taken (:meth:`optimizer_snapshot`) and everything else passed through (see
        the class); a future of it with ``async_staging=True``."""
        with self._lock:
            if self._closed:
                raise RuntimeError("CheckpointStager.stage() called after close()")
            if not self._idle.is_set():
                raise RuntimeError(
                    "CheckpointStager.stage() called while the previous staging is not "
                    "complete; wait for its staging_completion first"
                )
            self._wait_briefly_for_uploads()
            work = _Work()
            staged = self._walk(state_dict, (), work)
            if work.busy:
                self.overlapping_stagings += 1
            # Buffers of keys that this state dict no longer has are freed.
            self._cache = {path: self._cache[path] for path in work.paths}
            if work.copies:
                self._enqueue(work.copies, work)
            if work.device is None:  # nothing on a GPU
                if not self._async:
                    return staged
                done = Future()
                done.set_result(staged)
                return done
            event = self._stream.record_event()
            if work.snapshot:  # the optimizer's step() waits (on the GPU) for these copies
                self._snapshot_event = (work.device, event)
            if not self._async:
                return self._wait_for(event, staged, work.widen)
            self._idle.clear()
            return self._executor.submit(self._in_thread, work.device, event, staged, work.widen)

    def _wait_briefly_for_uploads(self):
        """Give an upload that has just completed up to 10 ms to drop its state dict: its
        thread sets the future first (so the caller may already be here), then lets go."""
        deadline = time.monotonic() + 0.01
        while any(view() is not None for _, view in self._cache.values()):
            if time.monotonic() > deadline:
                return
            time.sleep(0.001)

    def _in_thread(self, device, *args):
        """_wait_for in the stager's thread, with the staging's device current there: without
        one, the thread's first CUDA call may make a context on device 0 (as torch's
        DataLoader sets the device in its pin-memory thread)."""
        with torch.cuda.device(device):
            return self._wait_for(*args)

    def _wait_for(self, event, staged, widen):
        try:
            for copied, buffer, dtype in widen:  # each once its copy is done, beside the others
                copied.synchronize()
                _widen(buffer, dtype)
        finally:
            try:
                event.synchronize()  # also after a failed widening: the copies end anyway
                # The copies are done (those of any earlier snapshot came before them on the
                # side stream): later steps need not wait, and a step may be captured. No
                # staging sets it meanwhile: the next one is refused until this one is idle,
                # and a synchronous one runs this itself.
                self._snapshot_event = None
            finally:
                self._idle.set()
        return staged

    def _walk(self, value, path, work):
        if isinstance(value, _OptimizerSnapshot):
            return self._snapshot(value, path, work)
        if isinstance(value, DTensor):
            if value._local_tensor.device.type == "cpu":
                return value
            # As DTensor.to("cpu") makes it, the same spec (mesh, placements, shape, stride)
            # around a CPU local tensor, here the cached one. (DTensor.from_local() would move
            # a CPU local tensor to the mesh's device.)
            local = self._tensor(value._local_tensor, path, work)
            return DTensor(local, value._spec, requires_grad=False)
        if isinstance(value, torch.Tensor):
            return self._tensor(value, path, work)
        if isinstance(value, dict):
            return {k: self._walk(v, (*path, k), work) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            items = [self._walk(v, (*path, i), work) for i, v in enumerate(value)]
            return type(value)(items) if isinstance(value, list) else tuple(items)
        return copy.deepcopy(value)

    def _tensor(self, tensor, path, work):
        if not self._copied(tensor, path):
            return tensor
        view = self._buffer(path, tensor.shape, tensor.dtype, work)
        work.copies.append((path, view, tensor))
        return view

    def _buffer(self, path, shape, dtype, work):
        """The pinned buffer of `path`, the last one unless its upload still holds it."""
        buffer, last = self._cache.get(path, (None, None))
        if last is not None and last() is not None:
            work.busy.append(path)  # its upload is not done: this checkpoint gets a new buffer
            buffer = None
        if buffer is None or buffer.shape != shape or buffer.dtype != dtype:
            buffer = self._allocate(shape, dtype)
        # The staged state dict gets a view of the buffer, which DCP holds until the upload
        # is done: while it lives, the buffer is not reused.
        view = buffer.view(buffer.shape)
        self._cache[path] = (buffer, weakref.ref(view))
        work.paths.append(path)
        return view

    def _copied(self, tensor, path):
        """Whether `tensor` is copied (a CUDA tensor) or passed through (a CPU tensor)."""
        if tensor.device.type == "cpu":
            return False
        if tensor.device.type != "cuda":
            raise RuntimeError(
                f"CheckpointStager stages CPU and CUDA tensors; {_name(path)} is on {tensor.device}"
            )
        return True

    def _allocate(self, shape, dtype):
        """A new pinned CPU buffer."""
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def _side_stream(self, device, path, work):
        """The side stream, once per staging made to wait for the work already enqueued on
        the current stream (which may still be writing the sources)."""
        if device.type != "cuda":
            raise RuntimeError(
                f"CheckpointStager copies from CUDA devices; {_name(path)} is on {device}"
            )
        if work.device is None:
            if self._stream is None or self._stream.device != device:
                self._stream = torch.cuda.Stream(device=device)
            self._stream.wait_stream(torch.cuda.current_stream(device))
            work.device = device
        elif device != work.device:
            raise RuntimeError(
                "CheckpointStager stages the tensors of one CUDA device per process; "
                f"{_name(path)} is on {device}, others on {work.device}"
            )
        return self._stream

    def _enqueue(self, copies, work):
        """Enqueue the device-to-host copies on the side stream."""
        for path, _, src in copies:
            self._side_stream(src.device, path, work)
        with torch.cuda.stream(self._stream):
            for _, dst, src in copies:
                dst.copy_(src, non_blocking=True)
                src.record_stream(self._stream)

    def optimizer_snapshot(self, model, optimizer, *, options=None):
        """What ``get_optimizer_state_dict(model, optimizer, options=options)`` returns for a
        TE ``FusedAdam``, taken by this stager when ``dcp.async_save`` stages it, without the
        export's wait: put it in the state dict in place of that.

        At ``stage()``, the stager copies each state's own bytes (BF16, FP32 or int16; FP16 and
        FP8 states unscaled to FP32 on the GPU by ``FusedAdam.get_unscaled_state``, one state
        at a time) from the GPU into pinned FP32 (int16) buffers that it keeps for the next
        checkpoint, on its side stream, and the state dict that DCP writes holds those buffers,
        the BF16 ones converted to FP32 in place once copied: bitwise what
        ``FusedAdam.state_dict()`` exports, as CPU tensors (CPU DTensors for DTensor
        parameters), with the param groups staged as the rest of the state dict is. Until the
        copies are done, ``optimizer.step()`` makes the GPU wait for them (a step pre-hook; the
        CPU does not wait), so forward and backward run beside them. That hook covers
        ``step()`` of this optimizer only (not a step replayed from a CUDA graph): anything else
        that changes the optimizer's states, its param groups' GPU tensors or the model's
        parameters in place (a load, another optimizer, an in-place update, an LR scheduler
        stepped before the optimizer with a tensor ``lr``) must wait for the staging first
        (``staging_completion`` with ``async_staging=True``), and so must capturing a CUDA
        graph (the stager's thread waits on CUDA events meanwhile). Do not wait for
        ``staging_completion`` before ``optimizer.step()`` itself: it also covers the
        conversion on the CPU. :meth:`close` removes the hook; with a stager dropped without
        it, the hook stays and does nothing.

        Arguments:
            model (torch.nn.Module): as for ``get_optimizer_state_dict``; not FSDP1 (its
                optimizer state dict reshapes the values, which are not copied yet then).
            optimizer (FusedAdam): a TE ``FusedAdam`` (not a subclass that overrides
                ``state_dict()``) that has taken a step; ``state_dict_cpu_offload`` is not
                needed.
            options (StateDictOptions, optional): as for ``get_optimizer_state_dict``, but
                not ``full_state_dict`` (it would gather values not copied yet); leave
                ``cpu_offload`` off (the stager copies; with ``capturable=True`` it would copy
                the param groups' GPU tensors in the training thread, waiting for its stream).

        Host memory: the buffers hold the optimizer part of one checkpoint (4 bytes per state
        element, int16 remainders 2, as :meth:`cached_bytes` counts them; PyTorch's pinned
        allocator rounds each buffer up to a power of two) per process between checkpoints,
        until :meth:`close`; a checkpoint that overlaps an upload still writing them gets new
        ones (see the class). GPU memory:
        none for BF16, FP32 and int16 states; for FP16 and FP8 states, the FP32 copy of one
        state at a time. The returned object is for this stager's ``stage()`` only: pickling
        or deep-copying it raises a TypeError (``dcp.save`` reports it in its
        ``CheckpointException``), and another stager's ``stage()`` raises one too.
        """
        if self._closed:
            raise RuntimeError(
                "CheckpointStager.optimizer_snapshot() called after close(); make a new stager"
            )
        if options is not None and options.full_state_dict:
            raise ValueError(
                "CheckpointStager.optimizer_snapshot() does not take full_state_dict: it "
                "would gather states that are not copied yet"
            )
        fused_adam = next(
            (c for c in type(optimizer).__mro__ if "get_unscaled_state" in vars(c)), None
        )
        if fused_adam is None:
            raise TypeError(
                "CheckpointStager.optimizer_snapshot() takes a TE FusedAdam, got "
                f"{type(optimizer).__name__}"
            )
        if type(optimizer).state_dict is not fused_adam.state_dict:
            raise TypeError(
                f"CheckpointStager.optimizer_snapshot(): {type(optimizer).__name__} overrides "
                "state_dict(), which the snapshot would not follow"
            )
        if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
            raise ValueError(
                "CheckpointStager.optimizer_snapshot() does not take FSDP1 models (their "
                "optimizer state dict reshapes the states); use fully_shard (FSDP2)"
            )
        return _OptimizerSnapshot(self, model, optimizer, options)

    def _snapshot(self, snapshot, path, work):
        """The optimizer state dict of `snapshot`, its states copied into pinned buffers."""
        if snapshot.stager is not self:
            raise TypeError(
                "an optimizer_snapshot() of another CheckpointStager: pass it to the stager "
                "whose optimizer_snapshot() made it"
            )
        optimizer = snapshot.optimizer
        if not optimizer.state:
            raise RuntimeError(
                "CheckpointStager.optimizer_snapshot(): the optimizer has no states yet "
                "(before its first step)"
            )
        if optimizer not in self._hooks:
            hook = functools.partial(_wait_for_snapshot, weakref.ref(self))
            handle = optimizer.register_step_pre_hook(hook)
            self._hooks[optimizer] = handle
        params = [p for g in optimizer.param_groups for p in g["params"]]
        saved = torch.optim.Optimizer.state_dict(optimizer)  # indices and param_groups
        exports = {
            index: {
                name: self._export(optimizer, params[index], name, (*path, index, name), work)
                for name in names
            }
            for index, names in saved["state"].items()
        }
        work.snapshot = True
        # DCP maps the indices to names as it does FusedAdam.state_dict()'s; an instance
        # attribute of the same name (a wrapper's) is put back afterwards.
        own = vars(optimizer).get("state_dict")
        try:
            optimizer.state_dict = lambda: dict(saved, state=exports)
            state_dict = get_optimizer_state_dict(
                snapshot.model, optimizer, options=snapshot.options or StateDictOptions()
            )
        finally:
            if own is None:
                vars(optimizer).pop("state_dict", None)
            else:
                optimizer.state_dict = own
        # The param groups as the rest of a state dict: GPU tensors (capturable's step) copied
        # into pinned buffers, CPU tensors passed through (as with the export), others copied.
        return self._walk(state_dict, path, work)

    def _export(self, optimizer, param, name, path, work):
        """A pinned buffer (a view of it, in a DTensor for a DTensor `param`) that holds
        FusedAdam's export of the state `name` of `param` once the side stream's copies are
        done (BF16 states: once also widened)."""
        stream = self._side_stream(param.device, path, work)
        bf16 = optimizer.name_to_dtype_map[name] == torch.bfloat16
        with torch.cuda.stream(stream):
            # A BF16 state as it is (skip_unscale: the stager widens it on the CPU); FP16 and
            # FP8 states unscaled to FP32, FP32 and int16 states as they are.
            value = optimizer.get_unscaled_state(param, name, skip_unscale=bf16)
            if value.dtype not in ((torch.bfloat16,) if bf16 else (torch.float32, torch.int16)):
                raise RuntimeError(
                    "CheckpointStager.optimizer_snapshot(): get_unscaled_state() gave "
                    f"{value.dtype} for {_name(path)}"
                )
            if not value.is_contiguous():
                raise RuntimeError(
                    "CheckpointStager.optimizer_snapshot() needs contiguous states; "
                    f"{_name(path)} has stride {value.stride()}"
                )
            dtype = torch.int16 if value.dtype == torch.int16 else torch.float32
            buffer = self._buffer(path, value.shape, dtype, work)
            # The state's bytes fill the end of the buffer (all of it unless BF16).
            start = buffer.nbytes - value.nbytes
            buffer.view(-1).view(torch.uint8)[start:].view(value.dtype).copy_(
                value.view(-1), non_blocking=True
            )
            value.record_stream(stream)
            if bf16:
                work.widen.append((stream.record_event(), buffer, value.dtype))
        if not isinstance(param, DTensor):
            return buffer
        # The spec of the parameter with the export's dtype, as FusedAdam.state_dict() makes it.
        meta = param._spec.tensor_meta._replace(dtype=dtype)
        return DTensor(
            buffer, dataclasses.replace(param._spec, tensor_meta=meta), requires_grad=False
        )

    def cached_bytes(self):
        """Bytes of pinned CPU memory the stager holds for the next checkpoint."""
        return sum(t.numel() * t.element_size() for t, _ in self._cache.values())

    def synchronize_staging(self):
        """Wait until the last staging is complete (as ``staging_completion`` does)."""
        self._idle.wait()

    def close(self):
        """Wait for the last staging, free the pinned buffers (those that no upload still
        holds; the others when it lets go) and empty PyTorch's cache of pinned memory (the
        process's: other cached pinned blocks go too), giving it back to the system; remove
        the step pre-hooks of :meth:`optimizer_snapshot`. The stager cannot stage again."""
        with self._lock:
            self._closed = True
            self._idle.wait()
            if self._executor is not None:
                self._executor.shutdown(wait=True)
            self._cache.clear()
            for handle in list(self._hooks.values()):
                handle.remove()
            self._hooks.clear()
            self._snapshot_event = None
            if torch.cuda.is_available():
                _empty_host_cache()


class _Work:
    """What one staging collects while it walks the state dict."""

    def __init__(self):
        self.copies = []  # (path, pinned view, GPU tensor) of the GPU tensors (not the states)
        self.busy = []  # paths whose buffers an upload still holds
        self.paths = []  # paths of the buffers this staging uses
        self.widen = []  # (event of its copy, FP32 buffer, dtype of the state copied into its end)
        self.device = None  # the CUDA device, once the side stream waits for its stream
        self.snapshot = False  # whether an optimizer snapshot is in it


class _OptimizerSnapshot:
    """What CheckpointStager.optimizer_snapshot() returns, for that stager's stage()."""

    def __init__(self, stager, model, optimizer, options):
        self.stager, self.model, self.optimizer, self.options = stager, model, optimizer, options

    def __reduce__(self):
        raise TypeError(
            "what CheckpointStager.optimizer_snapshot() returns is staged only by its "
            "CheckpointStager: pass the state dict to dcp.async_save(..., async_stager=stager)"
        )


def _wait_for_snapshot(stager_ref, optimizer, args, kwargs):  # pylint: disable=unused-argument
    """Step pre-hook of optimizer_snapshot(): the step's work waits on the GPU for the copies
    of the stager's last snapshot while they are not done."""
    stager = stager_ref()
    if stager is None:
        return
    copied = stager._snapshot_event  # pylint: disable=protected-access
    if copied is not None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "optimizer.step() captured in a CUDA graph while the copies of a "
                "CheckpointStager.optimizer_snapshot() are not done; wait for its "
                "staging_completion before capturing"
            )
        device, event = copied
        torch.cuda.current_stream(device).wait_event(event)


def _widen(buffer, dtype):
    """Convert in place the `dtype` values copied into the end of the FP32 `buffer` into the
    FP32 values of all of it, front to back: each pass writes only bytes before the first
    value not yet read, and reads none that it writes, so a pass is one copy (parallel in
    PyTorch's intra-op threads)."""
    flat = buffer.view(-1)
    n, size = flat.numel(), flat.element_size()
    width = torch.empty((), dtype=dtype).element_size()
    assert width < size, (dtype, buffer.dtype)
    raw = flat.view(torch.uint8)[(size - width) * n :].view(dtype)
    done = 0
    while n - done > 2**16:
        end = ((size - width) * n + width * done) // size
        flat[done:end].copy_(raw[done:end])
        done = end
    flat[done:].copy_(raw[done:].clone())  # the last values overlap what they become


def _name(path):
    """A path in a state dict, for messages."""
    return "/".join(map(str, path))


def _empty_host_cache():
    """Free the pinned memory that PyTorch's caching host allocator keeps, where it can."""
    accelerator = getattr(torch, "accelerator", None)
    empty = getattr(accelerator, "empty_host_cache", None)  # torch >= 2.13
    if empty is None:
        empty = getattr(torch._C, "_host_emptyCache", None)  # pylint: disable=protected-access
    if empty is not None:
        empty()
