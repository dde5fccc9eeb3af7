"""A CheckpointStager whose "GPU" is the CPU, for the CPU tests (tests/tool/test_staging.py):
tensors marked `on_gpu` (and, for the optimizer snapshot, the optimizer's CPU states) are
copied on a stand-in side stream, a thread that runs its work `delay_s` after it is enqueued,
in order, as a CUDA stream runs its copies after stage() returned. A staging that did not wait
for its copies would hand out buffers that are not written yet."""

import contextlib
import queue
import threading
import time

import torch

from te_fusedadam_offload.staging import CheckpointStager


class Event:
    """Stands for a CUDA event: done once the stream has reached it."""

    def __init__(self):
        self.done = threading.Event()

    def synchronize(self):
        self.done.wait()

    def query(self):
        return self.done.is_set()


class Stream:
    """Stands for the side stream: a thread that runs what is enqueued, in order, each item
    `delay_s` after it was enqueued; `hold` (an Event) keeps it from starting until set."""

    def __init__(self, delay_s=0.2, hold=None):
        self.delay_s, self.hold = delay_s, hold
        self.enqueued = 0
        self._queue = queue.Queue()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        if self.hold is not None:
            self.hold.wait()
        while True:
            due, work = self._queue.get()
            time.sleep(max(0.0, due - time.monotonic()))
            work()

    def enqueue(self, work):
        self.enqueued += 1
        self._queue.put((time.monotonic() + self.delay_s, work))

    def record_event(self):
        event = Event()
        self._queue.put((time.monotonic(), event.done.set))
        return event


class StandIn(CheckpointStager):
    """CheckpointStager on the CPU: see the module."""

    def __init__(self, *, async_staging=False, delay_s=0.2, hold=None):
        super().__init__(async_staging=async_staging)
        self._stream = Stream(delay_s, hold)
        self.ordered = []  # events the "current stream" was made to wait for

    def _copy_device(self, tensor, path):
        if getattr(tensor, "on_gpu", False):
            return "gpu"
        return super()._copy_device(tensor, path)

    def _side_stream(self, device):
        return self._stream

    def _copy_on(self, stream, copies):
        grad = torch.is_grad_enabled()  # autograd records a CUDA copy when it is enqueued

        def copy():
            with torch.set_grad_enabled(grad):
                for dst, src in copies:
                    dst.copy_(src)

        if copies:
            stream.enqueue(copy)

    def _order_current(self, device, event):
        self.ordered.append(event)

    def _in_device(self, device):
        return contextlib.nullcontext()


def on_gpu(tensor):
    """`tensor`, marked as standing for a CUDA tensor."""
    tensor.on_gpu = True
    return tensor


def snapshot_stand_in(monkeypatch):
    """What the snapshot does with the side stream on a GPU does nothing here: entering it
    (torch.cuda.stream) and recording the sources' use on it."""
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
