"""A stager for ``torch.distributed.checkpoint.async_save`` that does not copy what is a copy.

``dcp.async_save`` stages (copies) the whole state dict before it writes it, in the training
thread unless a stager does it elsewhere. With ``FusedAdam(state_dict_cpu_offload=True)`` the
optimizer part of the state dict is already a private CPU copy (bitwise the default export),
and copying it again is most of the checkpoint stall (6.4 GB per rank at 2^29 parameter
elements with BF16 moments and FP32 master weights). :class:`CheckpointStager` copies only the
GPU tensors (the model's parameters and buffers, which training changes) into pinned CPU
buffers that it keeps for the next checkpoint, and passes CPU tensors through as they are::

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

This module is a runtime helper of this patch set, not TE code. It implements DCP's public
``AsyncStager`` protocol; of DTensor it uses the local tensor and the spec, as DCP's own
state-dict utilities and ``DTensor.to()`` do, to wrap a CPU copy of a GPU DTensor's shard.
"""

import copy
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

try:
    import torch
    from torch.distributed.checkpoint.staging import AsyncStager
    from torch.distributed.tensor import DTensor
except ImportError as exc:  # pragma: no cover (the message is tested in a torch-less process)
    raise ImportError(
        "te_fusedadam_offload.staging needs PyTorch with torch.distributed.checkpoint's "
        f"AsyncStager and DTensor ({exc}); install torch, or pip install "
        "'te-fusedadam-offload[staging]' where it is missing"
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
            updates) before ``response.staging_completion.result()`` returns.

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

    @property
    def should_synchronize_after_execute(self):
        """Staging is complete when stage() returns, or when its future is done."""
        return False

    def stage(self, state_dict):
        """The state dict with GPU tensors copied to the reused pinned buffers and everything
        else passed through (see the class); a future of it with ``async_staging=True``."""
        with self._lock:
            if self._closed:
                raise RuntimeError("CheckpointStager.stage() called after close()")
            if not self._idle.is_set():
                raise RuntimeError(
                    "CheckpointStager.stage() called while the previous staging is not "
                    "complete; wait for its staging_completion first"
                )
            self._wait_briefly_for_uploads()
            copies, busy = [], []
            staged = self._walk(state_dict, (), (copies, busy))
            if busy:
                self.overlapping_stagings += 1
            # Buffers of keys that this state dict no longer has are freed.
            self._cache = {path: self._cache[path] for path, _, _ in copies}
            if not copies or not self._async:
                if copies:
                    self._enqueue(copies).synchronize()
                if not self._async:
                    return staged
                done = Future()
                done.set_result(staged)
                return done
            event = self._enqueue(copies)
            self._idle.clear()
            return self._executor.submit(self._wait_for, event, staged)

    def _wait_briefly_for_uploads(self):
        """Give an upload that has just completed up to 10 ms to drop its state dict: its
        thread sets the future first (so the caller may already be here), then lets go."""
        deadline = time.monotonic() + 0.01
        while any(view() is not None for _, view in self._cache.values()):
            if time.monotonic() > deadline:
                return
            time.sleep(0.001)

    def _wait_for(self, event, staged):
        try:
            event.synchronize()
        finally:
            self._idle.set()
        return staged

    def _walk(self, value, path, work):
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
        copies, busy = work
        buffer, last = self._cache.get(path, (None, None))
        if last is not None and last() is not None:
            busy.append(path)  # its upload is not done: this checkpoint gets a new buffer
            buffer = None
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = self._allocate(tensor)
        # The staged state dict gets a view of the buffer, which DCP holds until the upload
        # is done: while it lives, the buffer is not reused.
        view = buffer.view(buffer.shape)
        self._cache[path] = (buffer, weakref.ref(view))
        copies.append((path, view, tensor))
        return view

    def _copied(self, tensor, path):
        """Whether `tensor` is copied (a CUDA tensor) or passed through (a CPU tensor)."""
        if tensor.device.type == "cpu":
            return False
        if tensor.device.type != "cuda":
            raise RuntimeError(
                f"CheckpointStager stages CPU and CUDA tensors; {'/'.join(map(str, path))} "
                f"is on {tensor.device}"
            )
        return True

    def _allocate(self, tensor):
        """A new pinned CPU buffer for `tensor`."""
        return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)

    def _enqueue(self, copies):
        """Enqueue the device-to-host copies on the side stream, after the work already
        enqueued on the current stream (which may still be writing the sources)."""
        device = copies[0][2].device
        for path, _, src in copies:
            if src.device != device:
                raise RuntimeError(
                    "CheckpointStager stages the tensors of one CUDA device per process; "
                    f"{'/'.join(map(str, path))} is on {src.device}, others on {device}"
                )
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device=device)
        self._stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self._stream):
            for _, dst, src in copies:
                dst.copy_(src, non_blocking=True)
                src.record_stream(self._stream)
        event = torch.cuda.Event()
        event.record(self._stream)
        return event

    def cached_bytes(self):
        """Bytes of pinned CPU memory the stager holds for the next checkpoint."""
        return sum(t.numel() * t.element_size() for t, _ in self._cache.values())

    def synchronize_staging(self):
        """Wait until the last staging is complete (as ``staging_completion`` does)."""
        self._idle.wait()

    def close(self):
        """Wait for the last staging and free the pinned buffers; the stager cannot stage
        again."""
        with self._lock:
            self._closed = True
            self._idle.wait()
            if self._executor is not None:
                self._executor.shutdown(wait=True)
            self._cache.clear()
