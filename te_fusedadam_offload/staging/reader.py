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

import contextlib
import copy
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

    Each data file is opened once per load, as ``FileSystemReader`` opens it: its headers,
    the direct reads and ``FileSystemReader.read_data``'s reads all go through that open file,
    so another checkpoint written to the same path meanwhile is never read at this one's
    offsets; and the load raises if, once the file is read, its path names another file (or
    the file changed size or was written), rather than give values of a checkpoint that is
    no longer there.

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
        targets = {
            item: planner.resolve_tensor(item).detach()
            for item in plan.items
            if item.type == LoadItemType.TENSOR
        }
        files = {}  # relative path: its items, in the order FileSystemReader.read_data reads
        for item in plan.items:
            files.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        self.fast_items = self.other_items = 0
        pool = ThreadPoolExecutor(self.thread_count, "ParallelFileSystemReader")
        try:
            for relative_path, items in files.items():
                self._read_file(plan, relative_path, items, targets, planner, pool)
        finally:
            pool.shutdown(cancel_futures=True)  # after a failure, the queued reads are dropped
        future = Future()
        future.set_result(None)
        return future

    def _read_file(self, plan, relative_path, items, targets, planner, pool):
        """Read the items of one file through one open of it: its headers, the direct reads
        (os.preadv on its descriptor, by the pool's threads) and FileSystemReader.read_data's
        reads; then refuse if its path no longer names that file as it was opened."""
        path = self.fs.concat_path(self.path, relative_path)
        with open(path, "rb") as file:
            opened = _identity(os.fstat(file.fileno()))
            reads, done, other = [], [], []  # (fd, offset, bytes); items read each way
            for item in items:
                target = targets.get(item)
                offset = None if target is None else self._direct(item, target, file)
                if offset is None:
                    other.append(item)
                    continue
                flat = _memory(target)
                for start in range(0, len(flat), CHUNK_BYTES):
                    reads.append((file.fileno(), offset + start, flat[start : start + CHUNK_BYTES]))
                done.append(item)
            for _ in pool.map(_read, *zip(*reads)) if reads else ():
                pass  # raises the first failure
            for item in done:
                torch.autograd.graph.increment_version(targets[item])  # written behind autograd
                planner.commit_tensor(item, targets[item])
            if other:  # through this open file: FileSystemReader would open its path again
                reader = copy.copy(self)
                reader.fs = _OpenFile(self.fs, path, file)
                FileSystemReader.read_data(
                    reader, dataclasses.replace(plan, items=other), _Resolved(planner, targets)
                )
            if _identity(os.fstat(file.fileno())) != opened or _identity(os.stat(path)) != opened:
                raise RuntimeError(
                    f"ParallelFileSystemReader: {path} was replaced while it was read (another "
                    "checkpoint written to this path?); load the checkpoint again"
                )
        self.fast_items += len(done)
        self.other_items += len(other)

    def _direct(self, item, target, file):
        """The offset in `file` of the bytes of `item`, read straight into `target`; None
        where FileSystemReader.read_data reads it."""
        info = self.storage_data[item.storage_index]
        if getattr(info, "transform_descriptors", None) or not _plain(target):
            return None
        if target.device.type != "cpu" or not target.is_contiguous():
            return None
        view = self._slice_file(file, info)
        # torch.save's byte order record, which torch.load (and its meta load) would follow.
        order = torch._C.PyTorchFileReader(view)  # pylint: disable=protected-access
        if not order.has_record("byteorder") or order.get_record("byteorder") != _ORDER:
            return None
        view.seek(0)
        # The stored tensor's metadata and where its bytes start in the item (torch.save's
        # archive): torch.load to the meta device reads no data.
        stored = torch.load(view, map_location="meta", weights_only=True)
        start = getattr(stored.untyped_storage(), "_checkpoint_offset", None)
        if not _plain(stored) or start is None:
            return None
        for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths)):
            stored = stored.narrow(dim, offset, length)
        if target.dtype != stored.dtype or target.shape != stored.shape:
            return None
        if not stored.is_contiguous():  # a part of the stored tensor that is not one run
            return None
        begin = start + stored.storage_offset() * stored.element_size()
        if begin + target.nbytes > info.length:  # not within the item: let torch.load say why
            return None
        return info.offset + begin


class _OpenFile:
    """The file system that FileSystemReader.read_data sees for the items of one file: that
    file, open already, in place of a new open of its path."""

    def __init__(self, fs, path, file):
        self._fs, self._path, self._file = fs, path, file

    def create_stream(self, path, mode):
        """The open file (left open), for its own path."""
        if os.fspath(path) != os.fspath(self._path) or mode != "rb":
            raise ValueError(f"ParallelFileSystemReader: {path} ({mode}) is not {self._path}")
        return contextlib.nullcontext(self._file)

    def __getattr__(self, name):
        return getattr(self._fs, name)


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


def _identity(stat):
    """What tells a file from the one that replaced it at its path, or from itself changed."""
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns


def _read(fd, offset, view):
    """Read len(view) bytes of the open file `fd` at `offset` into `view`."""
    done = 0
    while done < len(view):
        count = os.preadv(fd, [view[done:]], offset + done)
        if count == 0:
            raise EOFError(f"the file ends before byte {offset + len(view)}")
        done += count
