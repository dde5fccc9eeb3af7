"""A ``FileSystemReader`` for ``dcp.load`` that reads tensors straight into the template's
memory, with several threads.

DCP's ``FileSystemReader`` reads the tensors of a checkpoint one at a time: each with
``torch.load`` (which makes a new tensor of it) and then a copy into the template's tensor,
about 1.5 GB/s from memory that already holds the file. This reader reads the bytes of each
tensor that it can into the template's tensor itself, with ``os.preadv`` in a pool of threads;
the rest (values that are not tensors, transformed items, parts of a stored tensor that are not
contiguous in it, templates on a GPU, of another dtype or not contiguous, items whose header
fails a check or whose template tensor shares memory with another's, and every item of a
planner that finds, resolves or commits tensors or loads values its own way) go through
``FileSystemReader.read_data`` as before, through the same open file.
"""

import contextlib
import copy
import ctypes
import dataclasses
import errno
import io
import os
import pickletools
import struct
import sys
import zipfile
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

from .walk import memory, overlapping, span

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
    resolved. Each item's header is checked as strictly as ``torch.load`` checks what it
    reads: its zip record's local header (signature, name) where the central directory puts
    it, the record within the item, its size that of the pickled storage, the tensor within
    that; an item that fails a check goes through ``FileSystemReader.read_data`` too, which
    raises where ``torch.load`` raises. An item with a compressed, encrypted or directory zip
    record (torch.save writes none, and ``torch.load`` reads one unchecked, giving memory it
    never wrote) is refused with a ValueError.

    The direct reads need a planner whose ``resolve_tensor``, ``lookup_tensor``,
    ``transform_tensor``, ``commit_tensor`` and ``load_bytes`` are ``DefaultLoadPlanner``'s
    (its plan may be another's): every template tensor is resolved before the reads start,
    and a file's other values are loaded after its tensors, an order that only those hooks
    cannot tell from DCP's. The items whose template tensors share memory with another's (one
    tensor under two keys) go through ``FileSystemReader.read_data``, in DCP's order (the last
    key's value). With another planner, every item goes through
    ``FileSystemReader.read_data``, which resolves, reads and commits one item after the other
    (a ``lookup_tensor`` or ``load_bytes`` may depend on what the plan loaded before).
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
        if not _resolves_as_default(planner):  # DCP's order: resolve, read, commit, per item
            self.fast_items, self.other_items = 0, len(plan.items)
            return super().read_data(plan, planner)
        targets = {
            item: planner.resolve_tensor(item).detach()
            for item in plan.items
            if item.type == LoadItemType.TENSOR
        }
        shared = _sharing(targets)  # read one after the other, in DCP's order
        files = {}  # relative path: its items, in the order FileSystemReader.read_data reads
        for item in plan.items:
            files.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        self.fast_items = self.other_items = 0
        pool = ThreadPoolExecutor(self.thread_count, "ParallelFileSystemReader")
        try:
            for relative_path, items in files.items():
                self._read_file(plan, relative_path, items, targets, shared, planner, pool)
        finally:
            pool.shutdown(cancel_futures=True)  # after a failure, the queued reads are dropped
        future = Future()
        future.set_result(None)
        return future

    def _read_file(self, plan, relative_path, items, targets, shared, planner, pool):
        """Read the items of one file through one open of it: its headers, the direct reads
        (os.preadv on its descriptor, by the pool's threads) and FileSystemReader.read_data's
        reads; then refuse if its path no longer names that file as it was opened."""
        path = self.fs.concat_path(self.path, relative_path)
        with open(path, "rb") as file:
            opened = _identity(os.fstat(file.fileno()))
            reads, done, other = [], [], []  # (fd, offset, bytes); items read each way
            for item in items:
                target = targets.get(item)
                direct = target is not None and item not in shared
                offset = self._direct(item, target, file) if direct else None
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
                    f"ParallelFileSystemReader: {path} was replaced or changed while it was read"
                    " (another checkpoint written to this path?); load the checkpoint again"
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
        where = f"{file.name}, the item of {item.storage_index.fqn}"
        found = _record(_Slice(file.fileno(), info.offset, info.length), where)
        if found is None:
            return None
        stored, start = found
        for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths)):
            stored = stored.narrow(dim, offset, length)
        if target.dtype != stored.dtype or target.shape != stored.shape:
            return None
        if not stored.is_contiguous():  # a part of the stored tensor that is not one run
            return None
        return info.offset + start + stored.storage_offset() * stored.element_size()


def _resolves_as_default(planner):
    """Whether every hook that FileSystemReader.read_data calls, itself or through
    resolve_tensor, is DefaultLoadPlanner's own (the targets are the template's own tensors,
    found whatever was loaded before; a commit does nothing; a value loaded replaces its own
    key only), so that resolving every item, then reading the tensors, then the other values,
    loads what DCP's order (item after item) loads."""
    own = getattr(planner, "__dict__", {})
    return all(
        getattr(type(planner), name, None) is getattr(DefaultLoadPlanner, name) and name not in own
        for name in _HOOKS
    )


_HOOKS = ("resolve_tensor", "lookup_tensor", "transform_tensor", "commit_tensor", "load_bytes")


def _sharing(targets):
    """The items of `targets` (item: tensor) whose tensors share memory with another's."""
    spans = ((str(t.device), *memory(t), item) for item, t in targets.items() if t.numel())
    return {item for pair in overlapping(spans) for item in pair}


def _record(view, where):
    """(the stored tensor on the meta device, where its storage's bytes start in the item)
    for an item that is torch.save's archive of one plain tensor in this machine's byte order,
    checked as strictly as torch.load checks what it reads: every zip record stored as
    torch.save stores it (else a ValueError), the local header of the storage's record where
    the central directory puts it, with its name, the record within the item, its size that of
    the pickled storage and the tensor within it. None for anything else:
    FileSystemReader.read_data loads it, raising where torch.load raises."""
    archive = torch._C.PyTorchFileReader(view)  # pylint: disable=protected-access
    found = _storage_record(view, archive, where)
    # torch.save's byte order record, which torch.load (and its meta load) would follow.
    if not (found and archive.has_record("byteorder")) or archive.get_record("byteorder") != _ORDER:
        return None
    start, size = found
    numel = _pickled_numel(archive.get_record("data.pkl"))
    view.seek(0)
    # The stored tensor's metadata and where its storage starts in the item: torch.load to
    # the meta device reads no data, and grows a storage that the tensor overruns (torch.load
    # refuses such a tensor), hence the size pickled.
    stored = torch.load(view, map_location="meta", weights_only=True)
    if not _plain(stored) or numel is None or numel * stored.element_size() != size:
        return None
    if getattr(stored.untyped_storage(), "_checkpoint_offset", None) != start:
        return None  # the storage of another record
    if stored.storage_offset() * stored.element_size() + _span(stored) > size:
        return None
    return stored, start


def _storage_record(view, archive, where):
    """(where the bytes of the record data/0 start in the item, its size), None where its
    local header is not where the central directory puts it (its signature and name), the
    record is not within the item, or the central directory does not read the same with
    zipfile. Raises a ValueError for a record that is compressed, encrypted or a directory:
    torch.save writes none, and torch.load would read it unchecked, as memory it never wrote."""
    try:
        with zipfile.ZipFile(view) as archive_file:
            infos = archive_file.infolist()
    except (zipfile.BadZipFile, NotImplementedError, ValueError, OSError, struct.error):
        return None
    if len(infos) != len(archive.get_all_records()):
        return None
    for info in infos:
        if (
            info.compress_type != zipfile.ZIP_STORED
            or info.compress_size != info.file_size
            or info.flag_bits & _ENCRYPTED
            or info.external_attr & _DIRECTORY
            or info.is_dir()
        ):
            raise ValueError(
                f"ParallelFileSystemReader: {where}: its zip record {info.filename} is "
                "compressed, encrypted or a directory, which torch.save never writes and "
                "torch.load would read unchecked (a damaged checkpoint?)"
            )
    at = archive.get_record_header_offset("data/0")
    info = next((info for info in infos if info.header_offset == at), None)
    # torch 2.11's reader has no get_record_size(): there, zipfile's size alone is checked below.
    size = getattr(archive, "get_record_size", lambda _: None)("data/0")
    if info is None or size not in (None, info.file_size):
        return None
    view.seek(at)
    header = view.read(_LOCAL_HEADER.size)
    if len(header) != _LOCAL_HEADER.size:
        return None
    signature, name_length, extra_length = _LOCAL_HEADER.unpack(header)
    name = info.orig_filename.encode("utf-8" if info.flag_bits & _UTF8 else "cp437")
    if signature != b"PK\x03\x04" or view.read(name_length) != name:
        return None
    start = at + _LOCAL_HEADER.size + name_length + extra_length
    if start + info.file_size > view.length:
        return None
    return start, info.file_size


_LOCAL_HEADER = struct.Struct("<4s22xHH")  # a zip local file header: its signature, lengths
_ENCRYPTED, _UTF8, _DIRECTORY = 0x61, 0x800, 0x10  # zip flag bits, MS-DOS attribute
_MEMO = {"PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE", "FRAME"}  # leave the stack as it is
_COUNTS = {"INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4"}


def _pickled_numel(pickled):
    """The element count of the one storage that `pickled` (torch.save's data.pkl) loads:
    the last item of its persistent id, pushed just before the id's TUPLE; None for a pickle
    of another form."""
    try:
        ops = [(op.name, arg) for op, arg, _ in pickletools.genops(pickled) if op.name not in _MEMO]
    except Exception:  # pylint: disable=broad-exception-caught
        return None  # torch.load says why
    ids = [i for i, (name, _) in enumerate(ops) if name == "BINPERSID"]
    if len(ids) != 1 or ids[0] < 2:
        return None
    (count, numel), (pack, _) = ops[ids[0] - 2 : ids[0]]
    if count not in _COUNTS or pack != "TUPLE" or isinstance(numel, bool):
        return None
    return numel


class _Slice(io.RawIOBase):
    """Bytes [offset, offset + length) of the open file `fd`, a file of their own for
    torch.load and zipfile, read with os.preadv (no position shared with other readers)."""

    def __init__(self, fd, offset, length):
        super().__init__()
        self.fd, self.offset, self.length, self.position = fd, offset, length, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def seek(self, offset, whence=os.SEEK_SET):
        origin = {os.SEEK_SET: 0, os.SEEK_CUR: self.position, os.SEEK_END: self.length}[whence]
        if origin + offset < 0:
            raise OSError(errno.EINVAL, "seek before the start of the item")
        self.position = origin + offset
        return self.position

    def tell(self):
        return self.position

    def readinto(self, buffer):
        view = memoryview(buffer).cast("B")[: max(0, self.length - self.position)]
        count = os.preadv(self.fd, [view], self.offset + self.position) if len(view) else 0
        self.position += count
        return count


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


def _span(tensor):
    """Bytes from the first element of `tensor` to the end of its last one."""
    return span(tensor.dtype, tensor.shape, tensor.stride()) if tensor.numel() else 0


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
