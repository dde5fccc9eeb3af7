"""The walk of a state dict by a staging: what is copied, what is passed through, what is
refused.

Plain tensors and parameters (also as the local tensors of DTensors) are copied into the
stager's buffers: CPU tensors at once, in ``stage()``, since nothing orders them against later
updates; CUDA tensors on the stager's side stream. A CPU tensor is passed through only inside
:class:`Private`, where the caller vouches that nothing changes it until the upload is done.
Other tensor types and quantized tensors are refused with a TypeError (a tensor subclass copied
as its nominal dtype would be saved as something it is not). A Stateful at the top level is
taken as DCP takes it (:meth:`Walk.state_dict`). Dicts, lists, tuples and namedtuples are
walked; other values are deep-copied, except that one holding a tensor, or that cannot be
pickled to find out, is refused (a TypeError: deep-copied, it would bypass these rules), and
values of the :class:`Extension` type stage themselves.
"""

import copy
import pickle
from bisect import bisect_left

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

__all__ = ["Extension", "Private", "Specs", "Walk"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_ATOMS = (type(None), bool, int, float, complex, str, bytes)


class Extension:
    """A value that a stager stages its own way: ``stage_in(walk, path)`` returns what the
    staged state dict holds in its place. It is for its stager only: pickling or
    deep-copying it (as ``dcp.save`` and other stagers do with values they do not know)
    raises."""

    what = "a value marked by a CheckpointStager"

    def stage_in(self, walk, path):
        """What the staged state dict holds at `path` in place of this value."""
        raise NotImplementedError

    def __reduce__(self):
        raise TypeError(
            f"{self.what} is staged only by its CheckpointStager: pass the state dict to "
            "dcp.async_save(..., async_stager=stager)"
        )


class Private(Extension):
    """`value` whose CPU tensors (those of `tensors`, ids, or all) are private copies that
    nothing changes until the upload is done: passed through without a copy."""

    def __init__(self, value, tensors=None):
        self.value, self.tensors = value, tensors

    def passes(self, tensor):
        """Whether `tensor` is passed through."""
        return self.tensors is None or id(tensor) in self.tensors

    def stage_in(self, walk, path):
        outer, walk.private = walk.private, self
        try:
            return walk.value(self.value, path)
        finally:
            walk.private = outer


class Specs:
    """The buffer cache's stand-in in a walk of prepare(): it notes the buffer each path
    needs and gives a placeholder of that shape and dtype (one element, expanded)."""

    def __init__(self):
        self.specs = []  # (path, shape, dtype)

    def view(self, path, shape, dtype, **_):
        """A placeholder for the buffer of `path`; never held."""
        self.specs.append((path, shape, dtype))
        return torch.empty((), dtype=dtype).expand(shape), False


class Walk:
    """One staging's walk of a state dict: the staged state dict it returns, and what the
    stager does with it (the copies, the buffers used). Its mode: "stage", or "prepare"
    (buffers is a Specs) and "template" (the buffers without copies), whose copies are
    never run."""

    def __init__(self, stager, buffers, mode="stage", fresh=()):
        self.stager, self.buffers, self.mode = stager, buffers, mode
        self.fresh = fresh  # paths whose kept buffers a live tensor lies in: new ones
        self.cpu = []  # (buffer view, CPU tensor): copied in stage()
        self.gpu = []  # (buffer view, CUDA tensor): copied on the side stream
        self.deferred = []  # f(walk, stream), run once the GPU copies are enqueued (snapshot)
        self.finish = []  # (event, f()): run on the host once the event is done (the widening)
        self.paths = []  # paths of the buffers this staging uses
        self.held = []  # paths whose last buffers an upload still holds: new ones
        self.device = None  # the CUDA device of the copies
        self.private = None  # the Private being walked
        self.own = set()  # addresses of this staging's buffers that an Extension filled
        self.sources = {}  # template: the layout of a tensor's memory: (path, its buffer)
        self.lying = []  # (start, end) of the CPU tensors copied or passed through
        self.statefuls = []  # template: (key, Stateful) of the top level, kept as they are
        self.passed = []  # template: (device, start, end, path) of the private tensors passed

    @classmethod
    def apart(cls, stager, buffers, state_dict, mode="stage"):
        """A walk of `state_dict` (stage or template) and its staged form, in which no buffer
        reused holds a tensor that the walk copies or passes through: a load with
        assign=True may have kept a template's buffers as live tensors under any key, and a
        copy into them would change those. Such buffers' paths get new ones (as an
        overlapping staging's do) in a walk made again: rare, the next staging keeps them."""
        fresh = set()
        while True:
            kept = buffers.entries()
            walk = cls(stager, buffers, mode, fresh)
            staged = walk.state_dict(state_dict)
            lying = buffers.lying_in(walk.lying, walk.paths)
            if not lying:
                return walk, staged
            buffers.restore(kept)
            fresh = fresh | lying

    def state_dict(self, state_dict):
        """The staged form of a whole state dict. A Stateful at its top level (modules and
        optimizers are, by their methods) is taken as DCP takes it: as its state_dict(), which
        dcp.async_save stages; in a template, the caller's object itself, which dcp.load
        restores in place (its load_state_dict() with what it loaded into its state_dict())."""
        if isinstance(state_dict, dict):
            staged = {key: self._top(key, value) for key, value in state_dict.items()}
        else:
            staged = self.value(state_dict, ())
        if self.mode == "template":
            self._refuse_overlaps()
            self._refuse_stateful_overlaps()
        return staged

    def _top(self, key, value):
        """The staged form of `value`, at `key` of the state dict's top level."""
        if not isinstance(value, Stateful) or isinstance(value, (Extension, torch.Tensor)):
            return self.value(value, (key,))
        if self.mode == "template":
            self.statefuls.append((key, value))
            return value  # the caller's own, for dcp.load to restore
        return self.value(value.state_dict(), (key,))

    def value(self, value, path):
        """The staged form of `value`, at `path` in the state dict."""
        if isinstance(value, Extension):
            return value.stage_in(self, path)
        if isinstance(value, torch.Tensor):
            return self.tensor(value, path)
        if isinstance(value, dict):
            # Of its type, with its attributes, as the caller's own dict (DCP's template) has
            # them: a module's state dict is an OrderedDict whose _metadata (the modules'
            # versions) load_state_dict() reads, converting a state dict without it as old.
            staged = copy.copy(value)
            for k, v in value.items():
                staged[k] = self.value(v, (*path, k))
            return staged
        if type(value) in (list, tuple):  # pylint: disable=unidiomatic-typecheck
            return type(value)(self.value(v, (*path, i)) for i, v in enumerate(value))
        if isinstance(value, tuple) and hasattr(type(value), "_fields"):  # a namedtuple
            return type(value)(*(self.value(v, (*path, i)) for i, v in enumerate(value)))
        if type(value) in _ATOMS:  # pylint: disable=unidiomatic-typecheck
            return value
        if _holds_tensor(value, path):
            raise TypeError(
                f"CheckpointStager stages the tensors of dicts, lists and tuples; {name(path)} "
                f"is a {type(value).__name__} that holds a tensor: put its tensors in a dict"
            )
        return copy.deepcopy(value)

    def tensor(self, tensor, path):
        """A staged copy of `tensor`, or `tensor` itself where it is private."""
        if isinstance(tensor, DTensor):
            local = tensor._local_tensor
            _check_type(local, path)
            if self._passes(tensor, local, path):
                return tensor
            # As DTensor.to("cpu") makes it, the same spec (mesh, placements, shape, stride)
            # around a CPU local tensor. (DTensor.from_local() would move it to the mesh's
            # device.)
            return DTensor(self._copy(local, path), tensor._spec, requires_grad=False)
        _check_type(tensor, path)
        if self._passes(tensor, tensor, path):
            return tensor
        return self._copy(tensor, path)

    def _passes(self, tensor, local, path):
        if local.device.type != "cpu":
            return False
        if local.untyped_storage().data_ptr() in self.own:
            return True
        if self.private is None or not self.private.passes(tensor):
            return False
        self._lies(local)
        if self.mode == "template" and local.numel():
            self.passed.append((str(local.device), *memory(local), path))
        return True

    def _lies(self, tensor):
        """Note the CPU memory of `tensor`, which no buffer of this walk may be."""
        if tensor.numel():
            self.lying.append(memory(tensor))

    def _copy(self, tensor, path):
        device = self.stager._copy_device(tensor, path)
        # In a template, a tensor that an earlier one is (one tensor under two keys, tied
        # weights; or views of one memory through two storages) gets that one's buffer: DCP
        # loads both keys into it, and the last one read stays.
        layout = _layout(tensor) if self.mode == "template" and tensor.numel() else None
        if layout in self.sources:
            return self.sources[layout][1]
        view = self.buffer(path, tensor.shape, tensor.dtype)
        if layout is not None:
            self.sources[layout] = (path, view)
        if device is None:
            self._lies(tensor)
            self.cpu.append((view, tensor))
        else:
            self.use_device(device, path)
            self.gpu.append((view, tensor))
        return view

    def _spans(self):
        """In a template: (device, start, end, path) of the tensors given buffers."""
        return [
            (str(device), address, address + span(dtype, shape, stride), path)
            for (device, address, dtype, shape, stride, *_), (path, _) in self.sources.items()
        ]

    def _refuse_overlaps(self):
        """In a template: refuse two different views of overlapping memory (whatever their
        storages: two numpy views of one array), which DCP would load one over the other in
        part."""
        for owner, path in meeting(self._spans(), self.passed):
            raise ValueError(
                f"CheckpointStager.load_template(): {name(path)} shares memory with "
                f"{name(owner)}, a private tensor that the template passes through (dcp.load "
                f"loads into it in place), while {name(path)} would load into a buffer apart "
                "from it; pass that tensor once (or load into the state dict itself)"
            )
        for earlier, path in overlapping(self._spans()):
            raise ValueError(
                f"CheckpointStager.load_template(): {name(path)} and {name(earlier)} "
                "share memory but are different views of it, which DCP would load one "
                "over the other in part; pass one of them (or load into the state dict "
                "itself)"
            )

    def _refuse_stateful_overlaps(self):
        """In a template: refuse a tensor given a buffer that shares memory with a tensor of a
        top-level Stateful's state_dict() (the template keeps the Stateful as the caller's
        object, which dcp.load loads into in place): the two would load apart, where DCP
        loads both into that memory."""
        if not self.statefuls:
            return
        theirs = [
            (str(t.device), *memory(t), p)
            for key, stateful in self.statefuls
            for p, t in _tensors(stateful.state_dict(), (key,))
        ]
        for owner, path in meeting(self._spans(), theirs):
            raise ValueError(
                f"CheckpointStager.load_template(): {name(path)} shares memory with "
                f"{name(owner)}, a tensor of the Stateful {owner[0]!r}, which the template keeps "
                f"as your object (dcp.load loads into it in place), while {name(path)} would "
                "load into a buffer apart from it; pass that tensor once (or load into the "
                "state dict itself)"
            )

    def buffer(self, path, shape, dtype):
        """A view of the stager's buffer of `path` for this staging."""
        view, held = self.buffers.view(
            path, shape, dtype, track=self.mode == "stage", fresh=path in self.fresh
        )
        self.paths.append(path)
        if held:
            self.held.append(path)
        return view

    def use_device(self, device, path):
        """Note that `path` is copied from `device`: one device per staging."""
        if self.device is None:
            self.device = device
        elif device != self.device:
            raise RuntimeError(
                "CheckpointStager stages the tensors of one CUDA device per process; "
                f"{name(path)} is on {device}, others on {self.device}"
            )


class _Found(Exception):
    pass


class _TensorFinder(pickle.Pickler):
    """Pickles a value to nothing, raising _Found at its first tensor (torch.save finds
    storages the same way)."""

    def persistent_id(self, obj):
        if isinstance(obj, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)):
            raise _Found


class _Discard:
    def write(self, data):
        """Drop `data`."""


def _holds_tensor(value, path):
    """Whether pickling `value`, as DCP writes a value that is not a tensor, meets a tensor.
    A value that cannot be pickled is refused: a pickling that stopped may not have reached
    its tensors (a module's lambda hook stops it before its parameters), and DCP, which
    pickles it to save it, would fail."""
    try:
        _TensorFinder(_Discard(), protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    except _Found:
        return True
    except Exception as exc:  # pylint: disable=broad-exception-caught
        raise TypeError(
            f"CheckpointStager stages the tensors of dicts, lists and tuples; {name(path)} is a "
            f"{type(value).__name__} that cannot be pickled ({type(exc).__name__}: {exc}), so "
            "whether it holds a tensor is not known, and DCP could not save it: put its "
            "tensors and values in a dict"
        ) from exc
    return False


def _layout(tensor):
    """Which memory `tensor` is, and as what: a conjugate or negative view of it is another
    view (DCP reads each key through its own)."""
    view = tensor.dtype, tensor.shape, tensor.stride(), tensor.is_conj(), tensor.is_neg()
    return tensor.device, tensor.data_ptr(), *view


def memory(tensor):
    """(start, end) addresses of `tensor`'s bytes, from its first element to its last one."""
    return tensor.data_ptr(), tensor.data_ptr() + span(tensor.dtype, tensor.shape, tensor.stride())


def span(dtype, shape, stride):
    """Bytes from the first element of a tensor to the end of its last one (not empty)."""
    last = sum((size - 1) * step for size, step in zip(shape, stride))
    return (last + 1) * dtype.itemsize


def overlapping(spans):
    """Pairs (key of an earlier span, key) of the `spans`, (device, start, end, key) each,
    whose bytes overlap: each span with the one that reaches furthest before it."""
    furthest = None  # (device, start, end, key) of the span that reaches furthest
    for device, start, end, key in sorted(spans, key=lambda item: item[:3]):
        if furthest is not None and furthest[0] == device and start < furthest[2]:
            yield furthest[3], key
        if furthest is None or furthest[0] != device or end > furthest[2]:
            furthest = (device, start, end, key)


def meeting(spans, others):
    """Pairs (key of one of `others`, key) of the `spans` that overlap one of `others`, all
    (device, start, end, key): `others` sorted by address, with the one reaching furthest up
    to each, and each span's last one starting before its end found by bisection."""
    others = sorted(others, key=lambda item: item[:3])
    firsts = [item[:2] for item in others]
    reach = []  # the one of others[:i + 1] that reaches furthest on others[i]'s device
    for item in others:
        last = reach[-1] if reach else None
        keep = last is not None and last[0] == item[0] and last[2] >= item[2]
        reach.append(last if keep else item)
    for device, start, end, key in spans:
        i = bisect_left(firsts, (device, end)) - 1
        if i >= 0 and reach[i][0] == device and reach[i][2] > start:
            yield reach[i][3], key


def _tensors(value, path):
    """(path, tensor) of the strided, not empty tensors in `value` (DTensors' local ones),
    through dicts, lists and tuples."""
    value = value._local_tensor if isinstance(value, DTensor) else value
    if isinstance(value, torch.Tensor):
        if value.layout == torch.strided and value.numel():
            yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors(item, (*path, key))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _tensors(item, (*path, index))


def _check_type(tensor, path):
    """Refuse what a copy into a buffer of its dtype would not save as it is."""
    if type(tensor) not in _PLAIN:
        raise TypeError(_refusal(tensor, path))
    if tensor.layout != torch.strided:
        raise TypeError(
            f"CheckpointStager stages strided tensors; {name(path)} has layout {tensor.layout}"
        )
    if tensor.is_quantized:  # a plain type, but its values are not its dtype's bytes alone
        raise TypeError(
            f"CheckpointStager stages tensors that are not quantized; {name(path)} is quantized "
            f"({tensor.dtype}): dequantize it, or stage it with DCP's own staging"
        )


def _refusal(tensor, path):
    kind = type(tensor).__name__
    classes = {c.__name__ for c in type(tensor).__mro__}
    if "QuantizedTensor" in classes or "QuantizedTensorStorage" in classes:
        advice = (
            "TE's quantized weights (fp8_model_init, quantized_model_init) keep their data and "
            "scales in inner tensors, which a copy in its nominal dtype would save dequantized: "
            "save such a model with DCP's own staging (dcp.async_save without async_stager)"
        )
    elif "ShardedTensor" in classes:
        advice = (
            "FSDP1's sharded state dicts hold ShardedTensors; use FSDP2 (fully_shard), whose "
            "state dicts hold DTensors"
        )
    else:
        advice = "convert it to a plain tensor first, or stage it with DCP's own staging"
    return (
        "CheckpointStager stages plain tensors and parameters (also as the local tensors of "
        f"DTensors); {name(path)} is a {kind}: {advice}"
    )


def name(path):
    """A path in a state dict, for messages."""
    return "/".join(map(str, path))
