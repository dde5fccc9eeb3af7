"""A DCP ``AsyncStager`` that copies a state dict into host buffers it keeps from one
checkpoint to the next: its protocol and lifecycle. Nothing here is specific to TE.

Each ``stage()`` walks the state dict (:mod:`.walk`), copies its CPU tensors into the buffers
at once, enqueues the copies of its CUDA tensors on a side stream, and makes the current
stream wait for them, so that nothing the training enqueues after ``stage()`` returns can
change a tensor before it is copied. With ``async_staging=True`` a daemon thread waits for
the copies and completes the future that ``stage()`` returned; at the interpreter's exit, a
staging not complete after ``EXIT_WAIT_S`` is failed, so that a hung device does not keep
DCP's upload thread (which waits for it, and which the interpreter joins) from ending.
"""

import contextlib
import sys
import threading
import time
import warnings
import weakref
from concurrent.futures import Future, InvalidStateError, wait
from concurrent.futures import thread as _futures_thread  # pylint: disable=unused-import

import torch
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.tensor import DTensor

from .buffers import BufferCache, refuse_checkpoint_process
from .walk import Private, Specs, Walk, meeting, name

__all__ = ["PinnedStager", "empty_host_cache"]

# Threads that make a load template's buffers.
TEMPLATE_ALLOCATION_THREADS = 8
# How long the interpreter's exit waits for a staging that is not complete before failing it.
EXIT_WAIT_S = 60.0
_STAGERS = weakref.WeakSet()  # the stagers whose staging the exit may have to fail


class PinnedStager(AsyncStager):
    """Stage a state dict for ``dcp.async_save`` (pass it as ``async_stager``) into buffers
    of pinned host memory that it keeps for the next checkpoint.

    What it copies: plain tensors and parameters, also as the local tensors of DTensors (which
    keep their mesh, placements, shape and stride), from the CPU (at once, in ``stage()``) and
    from one CUDA device (on a side stream); a buffer is reused by the next checkpoint of the
    same key, shape and dtype, freed when a checkpoint no longer has the key. What it passes
    through: the CPU tensors of :meth:`private` and of :meth:`optimizer_export`. What it
    refuses: tensor subclasses, other layouts and quantized tensors (a TypeError that says
    what to do), values other than dicts, lists, tuples and namedtuples that hold a tensor,
    and DCP's checkpoint process (AsyncCheckpointerType.PROCESS: a ValueError, at once).
    Other values are deep-copied.

    Arguments:
        async_staging (bool, optional): with False (default), ``stage()`` returns when the
            copies are done, and ``dcp.async_save`` returns a future of the upload. With True,
            ``stage()`` enqueues the CUDA copies on a side stream and returns a future, and
            ``dcp.async_save`` an ``AsyncSaveResponse``; the current stream waits for those
            copies, so forward, backward and in-place updates on it (BatchNorm statistics)
            may run at once. Work on other streams and in other threads is not ordered:
            wait for ``staging_completion`` before it changes a staged tensor.

    Checkpoints that overlap: a buffer is reused only when nothing holds what the last
    staging made of it, that is when the upload that wrote it is done. A checkpoint that
    starts while an upload still holds its buffers gets new ones (``overlapping_stagings``
    counts such stagings), one more copy in pinned host memory until that upload is done.
    ``stage()`` waits up to 10 ms for DCP's upload thread to drop the last staged state dict
    after it completed the upload; a thread slower to drop it means new buffers too, counted alike.
    ``stage()`` raises a RuntimeError while the previous staging is not complete.
    """

    def __init__(self, *, async_staging=False):
        self._async = async_staging
        self._buffers = BufferCache(pin_memory=torch.cuda.is_available())
        self.overlapping_stagings = 0  # stagings that got new buffers: the old ones in use
        self._stream = None
        # Reentrant: a signal handler may call close() in the thread that is in stage().
        self._lock = threading.RLock()
        self._staging = False  # stage() or load_template() runs (in the thread holding the lock)
        self._closed = False
        self._freed = False
        # The future of the staging under way, until it is complete (then dropped: it holds
        # the staged state dict). Set before its thread starts, cleared by the thread once it
        # has completed the future; both under _pending_lock.
        self._pending = None
        self._pending_lock = threading.RLock()
        # (device, event) of the last staging's copies while they may not be done
        self._copies = None
        self._owner = None  # the thread that called stage(): the training's
        _STAGERS.add(self)

    @property
    def should_synchronize_after_execute(self):
        """Staging is complete when stage() returns, or when its future is done."""
        return False

    def stage(self, state_dict):
        """The state dict with its tensors copied into the stager's buffers (see the class);
        a future of it with ``async_staging=True``."""
        refuse_checkpoint_process()  # dcp.async_save with AsyncCheckpointerType.PROCESS
        with self._call("stage"):
            self._refuse_pending("stage() called while the previous staging is not complete")
            self._owner = threading.current_thread()
            return self._stage(state_dict)

    @contextlib.contextmanager
    def _call(self, method):
        """The lock, inference mode off (buffers made in it would be inference tensors, which
        no later staging outside it could write) and autograd off (as in DCP's stagers: a copy
        of a parameter would make the kept buffer a node of its graph) for `method`, which
        makes buffers or their thread; a close() from a signal handler in it leaves the
        freeing to its end, however it ends."""
        with self._lock, torch.inference_mode(False), torch.no_grad():
            self._staging = True  # before the check: a close() right after it is then seen
            try:
                if self._closed:
                    raise RuntimeError(f"CheckpointStager.{method}() called after close()")
                yield
            finally:
                self._staging = False
                if self._closed:  # close() ran inside this call (a signal handler)
                    self.close()

    def _refuse_pending(self, what):
        """Raise `what` while the last staging is not complete (its copies write the buffers)."""
        pending = self._pending
        if pending is not None and not pending.done():
            raise RuntimeError(f"CheckpointStager.{what}; wait for its staging_completion first")

    def _stage(self, state_dict):
        self._buffers.wait_prepared()
        self._buffers.wait_released(0.01)
        walk, staged = Walk.apart(self, self._buffers, state_dict)
        if walk.held:
            self.overlapping_stagings += 1
        self._buffers.keep_only(walk.paths)
        for dst, src in walk.cpu:  # before training goes on: nothing orders them
            dst.copy_(src)
        if walk.device is None:  # nothing on a GPU
            return self._done(staged)
        copies = self._enqueue(walk)
        if not self._async:
            self._finish(walk, copies)
            return staged
        return self._start(walk, copies, staged)

    def _done(self, staged):
        if not self._async:
            return staged
        done = Future()
        done.set_result(staged)
        return done

    def _enqueue(self, walk):
        """Enqueue the copies on the side stream, the tensors' first; the current stream
        waits for those. Returns (device, event of all of them)."""
        device = walk.device
        stream = self._side_stream(device)
        self._copy_on(stream, walk.gpu)
        self._order_current(device, stream.record_event())
        for enqueue in walk.deferred:
            enqueue(walk, stream)
        copies = (device, stream.record_event())
        self._copies = copies
        return copies

    def _start(self, walk, copies, staged):
        """The future of the staging, completed by a daemon thread once the copies are done."""
        future = Future()
        thread = threading.Thread(
            target=self._run, args=(future, walk, copies, staged), name="CheckpointStager"
        )
        thread.daemon = True  # a hung device must not keep the interpreter from exiting
        try:
            with self._pending_lock:
                self._pending = future
            thread.start()
        except BaseException:
            if thread.ident is None:  # it never ran: nothing else completes the staging
                with self._pending_lock:
                    self._pending = None
                self._copies = None
            raise
        return future

    def _run(self, future, walk, copies, staged):
        try:
            with self._in_device(copies[0]):
                self._finish(walk, copies)
        except BaseException as exc:  # pylint: disable=broad-exception-caught
            _complete(future, exception=exc)
        else:
            _complete(future, result=staged)
        self._drop_pending(future)  # once complete: synchronize_staging() waits for it

    def _finish(self, walk, copies):
        """Wait for the copies; run the host work that follows them (each once its own
        event is done, beside the others)."""
        try:
            for event, then in walk.finish:
                event.synchronize()
                then()
        finally:
            copies[1].synchronize()  # also after a failure: the copies end anyway
            if self._copies is copies:
                self._copies = None

    # Buffers before the first checkpoint.

    def prepare(self, state_dict):
        """Make the buffers that staging `state_dict` will take, in a background thread, so
        that the first checkpoint does not wait for pinned memory (while CUDA pins it, the
        other threads' CUDA calls wait: training loses about the time it takes).

        `state_dict` is what will be passed to ``dcp.async_save``, an
        :meth:`optimizer_snapshot` included (its optimizer must have taken a step), a
        ``Stateful`` at its top level taken as its ``state_dict()`` (as ``dcp.async_save``
        takes it); only its structure, shapes and dtypes are read, at once (a value that
        ``stage()`` would refuse raises here). ``stage()`` and :meth:`load_template` wait for
        a ``prepare()`` under way; :meth:`close` stops it. Returns a future of the bytes it
        allocated."""
        with self._call("prepare"):
            if self._buffers.preparing():
                raise RuntimeError("CheckpointStager.prepare() called while one is under way")
            specs = Specs()
            Walk(self, specs, mode="prepare").state_dict(state_dict)
            return self._buffers.prepare(specs.specs, stop=lambda: self._closed)

    def load_template(self, state_dict):
        """`state_dict` (as for ``dcp.async_save``) with each tensor that the stager would copy
        replaced by its buffer (those the stager lacks made by 8 threads at once), filled with
        that tensor's value (as ``stage()`` fills it): the template for ``dcp.load``, with no
        second copy in host memory, and then the buffers the next checkpoint reuses once the
        template is dropped (while it, or a tensor that a load kept of
        it, is alive, the next checkpoint takes new ones). A tensor that the load does not fill
        (``allow_partial_load``) keeps the state dict's value. An :meth:`optimizer_snapshot` in it
        gives the optimizer state dict as ``get_optimizer_state_dict`` does, its states in FP32
        (int16) buffers; an optimizer without states gets them as that function makes them (a step
        with zero gradients and learning rates). A ``Stateful`` at its top level (the DCP tutorial's
        ``AppState``, a module) is the caller's object itself in the template: ``dcp.load`` loads
        into its ``state_dict()`` and restores it in place, as without a template."""
        with self._call("load_template"):
            self._buffers.wait_prepared()
            self._refuse_pending("load_template() called while a staging is not complete")
            # The buffers that the cache lacks first, made by several threads at once: their
            # pinning is most of a template's time (7 GiB on an H200 host, with
            # pinned_use_cuda_host_register: 0.52-1.30 s by one thread, 0.27-0.30 s by eight).
            specs = Specs()
            Walk(self, specs, mode="template").state_dict(state_dict)
            self._buffers.allocate(
                specs.specs, stop=lambda: self._closed, threads=TEMPLATE_ALLOCATION_THREADS
            )
            # No keep_only(): a template of a part (the model, then the optimizer) keeps the
            # prepared buffers of the rest; the next stage() frees those it does not take.
            walk, template = Walk.apart(self, self._buffers, state_dict, mode="template")
            for dst, src in walk.cpu:
                dst.copy_(src)
            if walk.device is not None:
                self._finish(walk, self._enqueue(walk))
            return template

    # What touches the device, in one place (the CPU tests stand in for it).

    def _copy_device(self, tensor, path):
        """None for a tensor copied at once (CPU), the device for one copied on the side
        stream (CUDA); other devices raise."""
        if tensor.device.type == "cpu":
            return None
        if tensor.device.type != "cuda":
            raise RuntimeError(
                f"CheckpointStager stages CPU and CUDA tensors; {name(path)} is on {tensor.device}"
            )
        return tensor.device

    def _side_stream(self, device):
        """The side stream, made to wait for the work already enqueued on the current stream
        (which may still be writing the sources)."""
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device=device)
        self._stream.wait_stream(torch.cuda.current_stream(device))
        return self._stream

    def _copy_on(self, stream, copies):
        with torch.cuda.stream(stream):
            for dst, src in copies:
                dst.copy_(src, non_blocking=True)
                src.record_stream(stream)

    def _order_current(self, device, event):
        torch.cuda.current_stream(device).wait_event(event)

    def _in_device(self, device):
        # Without it, the thread's first CUDA call may make a context on device 0.
        return torch.cuda.device(device)

    # Private CPU tensors.

    @staticmethod
    def private(value):
        """`value` (a tensor or a nested dict/list of them) marked so that its CPU tensors
        are passed through without a copy: only for private copies that nothing changes
        until the upload is done."""
        return Private(value)

    @staticmethod
    def optimizer_export(model, optimizer, *, options=None):
        """``get_optimizer_state_dict(model, optimizer, options=options)``, with its CPU
        tensors that share no memory with the optimizer's states, the model or the param
        groups (at any depth: Adam's ``betas=(tensor, tensor)``) passed through (the private
        copies of an export, such as ``FusedAdam(state_dict_cpu_offload=True)``'s states),
        and the others (a CPU ``step`` or ``lr`` that the optimizer or a scheduler updates
        in place) copied. The export's tensors are told by memory only: an optimizer whose
        ``state_dict()`` (or a hook of it) returns CPU tensors that it keeps apart from its
        states and param groups and changes later (neither PyTorch's nor TE's do) must be
        staged as it is."""
        state_dict = get_optimizer_state_dict(
            model, optimizer, options=options or StateDictOptions()
        )
        live = _storage_spans(_leaves(list(optimizer.state.values())))  # nested ones too
        for group in optimizer.param_groups:  # Adam's betas=(tensor, tensor): in a tuple
            live += _storage_spans(_leaves({k: v for k, v in group.items() if k != "params"}))
        live += _storage_spans(model.parameters())
        live += _storage_spans(model.buffers())
        exported = _storage_spans(_leaves(state_dict))
        shared = {key for _, key in meeting(exported, live)}
        return Private(state_dict, {key for *_, key in exported} - shared)

    # Lifecycle.

    def cached_bytes(self):
        """Bytes of pinned host memory the stager holds for the next checkpoint."""
        return self._buffers.nbytes()

    def synchronize_staging(self):
        """Wait until the last staging is complete (as ``staging_completion`` does)."""
        pending = self._pending
        if pending is not None:
            wait([pending])
            self._drop_pending(pending)

    def _drop_pending(self, future):
        """Drop `future` (complete) unless a later stage() has put its own in its place."""
        with self._pending_lock:  # reentrant: close() may be called from a signal handler
            if self._pending is future:
                self._pending = None

    def close(self):
        """Wait for the last staging, free the buffers (those that no upload still holds; the
        others when it lets go) and empty PyTorch's cache of pinned memory (the process's:
        other cached pinned blocks go too). The stager cannot stage again. It may be called
        from a callback of ``staging_completion``; interrupted, it can be called again.
        Called from a signal handler while ``stage()`` runs in the thread it interrupted, it
        only marks the stager closed: that ``stage()`` frees the buffers at its end (whether
        the handler returns or its exception goes through it)."""
        with self._lock:
            self._closed = True
            if self._freed or self._staging:
                return
        self._buffers.wait_prepared()  # a prepare() stops at its next buffer
        self.synchronize_staging()
        self._copies = None
        self._buffers.clear()
        self._close_extensions()
        self._freed = True
        if torch.cuda.is_available():
            empty_host_cache()

    def _close_extensions(self):
        """What a subclass undoes at close()."""


def _complete(future, *, result=None, exception=None):
    """Complete `future` unless it is already (failed at the interpreter's exit)."""
    try:
        if exception is None:
            future.set_result(result)
        else:
            future.set_exception(exception)
    except InvalidStateError:
        pass


def _fail_stagings_at_exit():
    """At the interpreter's exit, fail the stagings not complete after EXIT_WAIT_S (a hung
    device), so that DCP's upload thread, which waits for them with no timeout and which the
    interpreter joins, lets it exit."""
    deadline = time.monotonic() + EXIT_WAIT_S
    for stager in list(_STAGERS):
        pending = stager._pending  # pylint: disable=protected-access
        if pending is None:
            continue
        wait([pending], timeout=max(0.0, deadline - time.monotonic()))
        if not pending.done():
            message = (
                "CheckpointStager: the interpreter exits with a staging not complete after "
                f"{EXIT_WAIT_S} s (a hung device?); its checkpoint is not written"
            )
            # Failed first, and the warning may not raise: a hook that raises stops the
            # interpreter's other exit hooks, the wait for uploads still in flight among them.
            _complete(pending, exception=RuntimeError(message))
            try:
                warnings.warn(message, RuntimeWarning)
            except Exception:  # pylint: disable=broad-exception-caught
                print(message, file=sys.stderr)


# DCP's upload thread is a ThreadPoolExecutor worker: concurrent.futures joins it at exit in a
# hook of threading._register_atexit (atexit.register runs only after the interpreter has
# joined every thread that is not a daemon: too late). Those hooks run last registered first,
# and concurrent.futures.thread (imported above) registered its own: this one runs before it.
threading._register_atexit(_fail_stagings_at_exit)  # pylint: disable=protected-access


def _storage_spans(tensors):
    """(device, start, end, id) of the memory of the storage of each of `tensors` (a DTensor's
    local tensor's) that has one: all that a tensor of it may reach, whatever storage another
    tensor reaches that memory by (torch.frombuffer of a part of it)."""
    spans = []
    for tensor in tensors:
        local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
        if not isinstance(local, torch.Tensor):
            continue
        try:
            storage = local.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):  # a subclass without storage
            continue  # (as a leaf of the export: copied, or refused)
        if storage.data_ptr():
            start = storage.data_ptr()
            spans.append((str(local.device), start, start + storage.nbytes(), id(tensor)))
    return spans


def _leaves(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _leaves(v)
    elif isinstance(value, torch.Tensor):
        yield value


def empty_host_cache():
    """Free the pinned memory that PyTorch's caching host allocator keeps, where it can."""
    accelerator = getattr(torch, "accelerator", None)
    empty = getattr(accelerator, "empty_host_cache", None)  # torch >= 2.13
    if empty is None:
        empty = getattr(torch._C, "_host_emptyCache", None)  # pylint: disable=protected-access
    if empty is not None:
        empty()
