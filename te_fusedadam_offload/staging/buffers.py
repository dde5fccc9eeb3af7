"""The host buffers that a stager keeps from one checkpoint to the next.

Nothing here needs CUDA: the buffers are pinned where PyTorch has CUDA and plain CPU memory
otherwise, so the reuse policy is tested on any machine. They stay in this process: staging
for DCP's checkpoint process is refused (:func:`refuse_checkpoint_process`).
"""

import inspect
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from .walk import meeting

__all__ = ["BufferCache", "refuse_checkpoint_process"]


class BufferCache:
    """One buffer per path of the state dict, reused by the next staging of that path when
    its shape and dtype are the same and no upload still holds what the last staging made of
    it (the view it returned: DCP drops the staged state dict once the upload is done)."""

    def __init__(self, *, pin_memory):
        self.pin_memory = pin_memory
        # path -> (buffer, weak reference to the view of it that the last staging returned)
        self._entries = {}
        self._lent = set()  # paths whose buffers a load template was given last
        self._preparing = None  # the future of the last prepare()

    def view(self, path, shape, dtype, *, track=True, fresh=False):
        """A view of the buffer of `path` for this staging, and whether the last buffer was
        still held (an upload not done), so that this one is new. With track=False, the view
        is a load template's: the next staging (or template) reuses that buffer only once no
        tensor holds its memory but the cache's own (:func:`_taken`). With fresh=True, the
        buffer is new (a live tensor lies in the kept one: :meth:`lying_in`)."""
        buffer, last = self._entries.get(path, (None, None))
        held = last is not None and last() is not None
        taken = path in self._lent and _taken(buffer)
        if held or fresh or taken or not _fits(buffer, shape, dtype):
            buffer = torch.empty(shape, dtype=dtype, pin_memory=self.pin_memory)
        view = buffer.view(buffer.shape)
        self._entries[path] = (buffer, weakref.ref(view) if track else None)
        if track:
            self._lent.discard(path)
        else:
            self._lent.add(path)
        return view, held

    def prepare(self, specs, stop):
        """allocate(specs, stop) in a daemon thread; a future of the bytes made."""
        future = Future()
        thread = threading.Thread(
            target=self._prepare, args=(future, specs, stop), name="CheckpointStager.prepare"
        )
        thread.daemon = True
        self._preparing = future
        try:
            thread.start()
        except BaseException:
            if thread.ident is None:  # it never ran: nothing would complete the future
                self._preparing = None
            raise
        return future

    def _prepare(self, future, specs, stop):
        try:
            made = self.allocate(specs, stop)
        except BaseException as exc:  # pylint: disable=broad-exception-caught
            future.set_exception(exc)
        else:
            future.set_result(made)

    def preparing(self):
        """Whether a prepare() is under way."""
        return self._preparing is not None and not self._preparing.done()

    def wait_prepared(self):
        """Wait for the last prepare()."""
        if self._preparing is not None:
            wait([self._preparing])

    def allocate(self, specs, stop, *, threads=1):
        """Make the buffers of `specs` ([(path, shape, dtype)]) that the cache lacks, by
        `threads` threads, each buffer unless stop() is true; they join the cache together at
        the end (another thread may read it meanwhile), none if stop() was. Returns the bytes
        made."""
        missing = {}
        for path, shape, dtype in specs:
            buffer, _ = self._entries.get(path, (None, None))
            if not _fits(buffer, shape, dtype):
                missing[path] = (shape, dtype)

        def make(spec):
            if stop():
                return None
            return torch.empty(spec[0], dtype=spec[1], pin_memory=self.pin_memory)

        if threads > 1 and len(missing) > 1:
            with ThreadPoolExecutor(
                min(threads, len(missing)), "CheckpointStager.allocate"
            ) as pool:
                made = list(pool.map(make, missing.values()))
        else:
            made = list(map(make, missing.values()))
        if any(b is None for b in made):
            return 0
        self._entries.update((path, (b, None)) for path, b in zip(missing, made))
        return sum(b.numel() * b.element_size() for b in made)

    def lying_in(self, spans, paths):
        """The paths of `paths` whose kept buffers hold a byte of the `spans` ((start, end) of
        CPU memory: the tensors that a staging copies or passes through, which a load with
        assign=True may have left in the buffers of any path)."""
        paths = set(paths)
        kept = [
            ("cpu", buffer.data_ptr(), buffer.data_ptr() + buffer.nbytes, path)
            for path, (buffer, _) in self._entries.items()
            if path in paths and buffer.nbytes
        ]
        return {path for _, path in meeting(kept, [("cpu", *span, None) for span in spans])}

    def entries(self):
        """The buffers kept, for :meth:`restore`."""
        return dict(self._entries), set(self._lent)

    def restore(self, entries):
        """Keep `entries` (of :meth:`entries`) again: a walk made again makes its own."""
        self._entries, self._lent = entries

    def keep_only(self, paths):
        """Free the buffers of the paths that the last staging did not have."""
        paths = set(paths)
        self._entries = {p: entry for p, entry in self._entries.items() if p in paths}
        self._lent &= paths

    def wait_released(self, timeout_s):
        """Give an upload that has just completed up to `timeout_s` to drop its state dict:
        its thread sets the upload's future first (so the caller may already be staging the
        next checkpoint), then lets go."""
        deadline = time.monotonic() + timeout_s
        while any(view is not None and view() is not None for _, view in self._views()):
            if time.monotonic() > deadline:
                return
            time.sleep(0.001)

    def nbytes(self):
        """Bytes of the buffers kept."""
        return sum(b.numel() * b.element_size() for b, _ in self._views())

    def pointers(self):
        """The buffers' addresses, sorted (to tell a reused buffer from a new one)."""
        return sorted(b.data_ptr() for b, _ in self._views())

    def _views(self):
        return list(self._entries.values())  # a copy: a prepare() thread may update it

    def clear(self):
        """Drop every buffer (one that an upload still holds is freed when it lets go)."""
        self._entries.clear()
        self._lent.clear()


def _fits(buffer, shape, dtype):
    """Whether `buffer` (None: none yet) is of `shape` and `dtype`."""
    return buffer is not None and buffer.shape == shape and buffer.dtype == dtype


def _taken(buffer):
    """Whether a tensor other than `buffer` holds its memory: the load template's tensor, or
    what a load made of it (a module's buffer or parameter with ``load_state_dict(...,
    assign=True)``, an optimizer's CPU state, which ``load_state_dict`` keeps as it is), which
    a copy into the buffer would change wherever it is (the state dict staged may not have
    it). Told by the count of references to its storage: the buffer's and, while this runs,
    its Python object's."""
    if buffer is None:
        return False
    # pylint: disable-next=protected-access
    return torch._C._storage_Use_Count(buffer.untyped_storage()._cdata) > 2


PROCESS_REFUSED = (
    "CheckpointStager does not stage for DCP's checkpoint process (dcp.async_save(..., "
    "async_checkpointer_type=AsyncCheckpointerType.PROCESS)): sending the staged state dict to "
    "it moves each CPU tensor into new shared memory, so after the first checkpoint the "
    "stager's pinned buffers would be pageable shared memory (stage() then waits for slower "
    "GPU copies) and the passed-through tensors would be copied at every checkpoint. Use the "
    "thread checkpointer, async_save's default: AsyncCheckpointerType.THREAD"
)


def refuse_checkpoint_process():
    """Raise a ValueError, before anything is copied, when called (by stage()) from
    ``dcp.async_save(..., async_checkpointer_type=AsyncCheckpointerType.PROCESS)``, read in
    its frame: DCP tells a stager nothing else of it before the upload. Its executor sends the
    staged state dict through a torch.multiprocessing pipe, whose pickling moves each CPU
    tensor's memory, in place, into new shared memory (a copy), which the process maps: the
    values arrive, but the kept buffers are then pinned no more."""
    frame = inspect.currentframe()
    while frame is not None:
        if (
            frame.f_code.co_name == "async_save"
            and frame.f_globals.get("__name__") == "torch.distributed.checkpoint.state_dict_saver"
        ):
            kind = frame.f_locals.get("async_checkpointer_type")
            if getattr(kind, "value", None) == "process":
                raise ValueError(PROCESS_REFUSED)
            return
        frame = frame.f_back
