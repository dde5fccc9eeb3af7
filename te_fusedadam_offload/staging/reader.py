"""A ``FileSystemReader`` for ``dcp.load`` that reads tensors straight into the template's
memory, with several threads.

DCP's ``FileSystemReader`` reads the tensors of a checkpoint one at a time: each with
``torch.load`` (which makes a new tensor of it) and then a copy into the template's tensor,
about 1.5 GB/s from memory that already holds the file. This reader reads the bytes of each
tensor that it can into the template's tensor itself, with ``os.preadv`` in a pool of threads;
the rest (values that are not tensors, transformed items, parts of a stored tensor that are not
contiguous in it, templates on a GPU, of another dtype or not contiguous) go through
``FileSystemReader.read_data`` as before.
"""

import ctypes
import dataclasses
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

__all__ = ["ParallelFileSystemReader"]

CHUNK_BYTES = 64 << 20  # one read of a thread


class ParallelFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose tensors are read with ``os.preadv`` straight into the
    template's tensors, by `thread_count` threads.

    A tensor item is read so when the checkpoint stores it plainly (no stream transform, a
    strided tensor without conjugate or negative bit, written in this machine's byte order),
    its template tensor is a contiguous strided CPU tensor of the stored dtype, and the part
    read is contiguous in the stored tensor (a whole tensor, whole rows, a part of one row);
    other items are read by ``FileSystemReader.read_data``, with the template tensors already
    resolved. Every template tensor of the direct reads is resolved before the reads start (a
    planner whose ``resolve_tensor`` makes temporaries holds them all at once).
    ``fast_items`` and ``other_items`` count the items of the last ``read_data`` each way.

    Arguments:
        path (str or os.PathLike): the checkpoint's directory, as for ``FileSystemReader``.
        thread_count (int, optional): threads that read (default 16).
    """

    def __init__(self, path, *, thread_count=16):
        if isinstance(thread_count, bool) or not isinstance(thread_count, int) or thread_count < 1:
            raise ValueError(f"thread_count must be a positive int, got {thread_count!r}")
        super().__init__(path)
        self.thread_count = thread_count
        self.fast_items = self.other_items = 0

    def read_data(self, plan, planner):
        reads, done, other = [], [], {}  # (path, offset, bytes); (item, tensor); item: tensor
        opened = {}  # the file of the last item (one file per rank: all of them)
        try:
            for item in plan.items:
                target, found = self._direct(item, planner, opened)
                if found is None:
                    other[item] = target
                    continue
                path, offset = found
                flat = _memory(target)
                for start in range(0, len(flat), CHUNK_BYTES):
                    reads.append((path, offset + start, flat[start : start + CHUNK_BYTES]))
                done.append((item, target))
        finally:
            for file in opened.values():
                file.close()
        pool = ThreadPoolExecutor(self.thread_count, "ParallelFileSystemReader")
        try:
            for _ in pool.map(_read, *zip(*reads)) if reads else ():
                pass  # raises the first failure
        finally:
            pool.shutdown(cancel_futures=True)  # after a failure, the queued reads are dropped
        for item, target in done:
            torch.autograd.graph.increment_version(target)  # written behind autograd's back
            planner.commit_tensor(item, target)
        self.fast_items, self.other_items = len(done), len(other)
        if other:
            items = list(other)
            return super().read_data(
                dataclasses.replace(plan, items=items), _Resolved(planner, other)
            )
        future = Future()
        future.set_result(None)
        return future

    def _direct(self, item, planner, opened):
        """(template tensor or None, (file path, offset of its bytes there) if read directly,
        else None)."""
        if item.type != LoadItemType.TENSOR:
            return None, None
        target = planner.resolve_tensor(item).detach()
        info = self.storage_data[item.storage_index]
        if getattr(info, "transform_descriptors", None) or not _plain(target):
            return target, None
        if target.device.type != "cpu" or not target.is_contiguous():
            return target, None
        path = self.fs.concat_path(self.path, info.relative_path)
        if path not in opened:
            for file in opened.values():
                file.close()
            opened.clear()
            opened[path] = open(path, "rb")  # pylint: disable=consider-using-with
        view = self._slice_file(opened[path], info)
        # torch.save's byte order record, which torch.load (and its meta load) would follow.
        order = torch._C.PyTorchFileReader(view)  # pylint: disable=protected-access
        if not order.has_record("byteorder") or order.get_record("byteorder") != _ORDER:
            return target, None
        view.seek(0)
        # The stored tensor's metadata and where its bytes start in the item (torch.save's
        # archive): torch.load to the meta device reads no data.
        stored = torch.load(view, map_location="meta", weights_only=True)
        start = getattr(stored.untyped_storage(), "_checkpoint_offset", None)
        if not _plain(stored) or start is None:
            return target, None
        for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths)):
            stored = stored.narrow(dim, offset, length)
        if target.dtype != stored.dtype or target.shape != stored.shape:
            return target, None
        if not stored.is_contiguous():  # a part of the stored tensor that is not one run
            return target, None
        begin = start + stored.storage_offset() * stored.element_size()
        if begin + target.nbytes > info.length:  # not within the item: let torch.load say why
            return target, None
        return target, (path, info.offset + begin)


class _Resolved:
    """The planner of the items left to FileSystemReader.read_data, which gives the template
    tensors that ParallelFileSystemReader resolved already (one resolve_tensor per item)."""

    def __init__(self, planner, resolved):
        self._planner, self._resolved = planner, resolved

    def resolve_tensor(self, item):
        """The tensor resolved for `item`."""
        return self._resolved[item]

    def __getattr__(self, name):
        return getattr(self._planner, name)


_ORDER = sys.byteorder.encode()


def _plain(tensor):
    """A strided tensor of the plain type whose bytes are its values."""
    return (
        type(tensor) is torch.Tensor  # pylint: disable=unidiomatic-typecheck
        and tensor.layout == torch.strided
        and not (tensor.is_conj() or tensor.is_neg() or tensor.is_quantized)
    )


def _memory(tensor):
    """The bytes of a contiguous CPU tensor, writable (a memoryview; no numpy needed)."""
    if not tensor.nbytes:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * tensor.nbytes).from_address(tensor.data_ptr()))


def _read(path, offset, view):
    """Read len(view) bytes of the file at `offset` into `view`."""
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < len(view):
            count = os.preadv(fd, [view[done:]], offset + done)
            if count == 0:
                raise EOFError(f"{path} ends before byte {offset + len(view)}")
            done += count
    finally:
        os.close(fd)
