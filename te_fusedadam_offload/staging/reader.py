"""A ``FileSystemReader`` for ``dcp.load`` that reads tensors straight into the template's
memory, with several threads.

DCP's ``FileSystemReader`` reads the tensors of a checkpoint one at a time: each with
``torch.load`` (which makes a new tensor of it) and then a copy into the template's tensor,
about 1.5 GB/s from memory that already holds the file. This reader reads the bytes of each
tensor that it can into the template's tensor itself, with ``os.preadv`` in a pool of threads;
the rest (values that are not tensors, transformed or resharded items, templates on a GPU or of
another dtype, non-contiguous ones) go through ``FileSystemReader.read_data`` as before.
"""

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

    A tensor item is read so when the checkpoint stores it plainly (no stream transform), its
    template tensor is a contiguous CPU tensor of the stored dtype, and the part read is
    contiguous in the stored tensor (a whole tensor, or whole rows of it); other items are
    read by ``FileSystemReader.read_data``. The bytes are the file's, as ``torch.load`` gives
    them on a little-endian machine (it refuses another). ``fast_items`` and ``other_items``
    count the items of the last ``read_data`` each way.

    Arguments:
        path (str or os.PathLike): the checkpoint's directory, as for ``FileSystemReader``.
        thread_count (int, optional): threads that read (default 16).
    """

    def __init__(self, path, *, thread_count=16):
        if not isinstance(thread_count, int) or thread_count < 1:
            raise ValueError(f"thread_count must be a positive int, got {thread_count!r}")
        if sys.byteorder != "little":
            raise RuntimeError("ParallelFileSystemReader reads on little-endian machines only")
        super().__init__(path)
        self.thread_count = thread_count
        self.fast_items = self.other_items = 0

    def read_data(self, plan, planner):
        reads, done, other = [], [], []  # (path, file offset, uint8 view); (item, tensor); items
        opened = {}  # the file of the last item (one file per rank: all of them)
        try:
            for item in plan.items:
                found = self._direct(item, planner, opened)
                if found is None:
                    other.append(item)
                    continue
                target, path, offset = found
                flat = target.reshape(-1).view(torch.uint8).numpy()
                for start in range(0, flat.size, CHUNK_BYTES):
                    reads.append((path, offset + start, flat[start : start + CHUNK_BYTES]))
                done.append((item, target))
        finally:
            for file in opened.values():
                file.close()
        with ThreadPoolExecutor(self.thread_count, "ParallelFileSystemReader") as pool:
            for _ in pool.map(_read, *zip(*reads)) if reads else ():
                pass  # raises the first failure
        for item, target in done:
            planner.commit_tensor(item, target)
        self.fast_items, self.other_items = len(done), len(other)
        if other:
            return super().read_data(dataclasses.replace(plan, items=other), planner)
        future = Future()
        future.set_result(None)
        return future

    def _direct(self, item, planner, opened):
        """(template tensor, file path, offset of its bytes there) of an item read directly,
        or None."""
        if item.type != LoadItemType.TENSOR:
            return None
        info = self.storage_data[item.storage_index]
        if getattr(info, "transform_descriptors", None):
            return None
        path = self.fs.concat_path(self.path, info.relative_path)
        if path not in opened:
            for file in opened.values():
                file.close()
            opened.clear()
            opened[path] = open(path, "rb")  # pylint: disable=consider-using-with
        # The stored tensor's metadata and where its bytes start in the item (torch.save's
        # archive): torch.load to the meta device reads no data.
        stored = torch.load(
            self._slice_file(opened[path], info), map_location="meta", weights_only=True
        )
        start = getattr(stored.untyped_storage(), "_checkpoint_offset", None)
        if not _plain(stored) or start is None:
            return None
        for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths)):
            stored = stored.narrow(dim, offset, length)
        target = planner.resolve_tensor(item).detach()
        if not (_plain(target) and target.device.type == "cpu" and target.is_contiguous()):
            return None
        if (target.dtype, target.shape) != (
            stored.dtype,
            stored.shape,
        ) or not stored.is_contiguous():
            return None
        return target, path, info.offset + start + stored.storage_offset() * stored.element_size()


def _plain(tensor):
    return type(tensor) is torch.Tensor  # pylint: disable=unidiomatic-typecheck


def _read(path, offset, view):
    """Read len(view) bytes of the file at `offset` into `view`."""
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < view.size:
            count = os.preadv(fd, [view[done:]], offset + done)
            if count == 0:
                raise EOFError(f"{path} ends before byte {offset + view.size}")
            done += count
    finally:
        os.close(fd)
