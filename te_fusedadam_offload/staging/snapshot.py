"""TE FusedAdam's optimizer snapshot: the stager copies the optimizer states themselves.

With ``FusedAdam(state_dict_cpu_offload=True)`` the export is a private CPU copy, but making
it is most of a checkpoint's stall. :meth:`CheckpointStager.optimizer_snapshot` puts in its
place a value that the stager stages itself: each state's own bytes copied on its side stream
into buffers that it keeps (BF16 widened to FP32 on the host afterwards, FP16 and FP8 unscaled
to FP32 on the GPU by ``FusedAdam.get_unscaled_state``), bitwise what ``state_dict()``
exports, while ``optimizer.step()`` waits on the GPU for those copies (a step pre-hook).
TE's FusedAdam is recognized by its methods; nothing of TE is imported.
"""

import dataclasses
import functools
import threading
import weakref

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.tensor import DTensor

from . import widening
from .stager import PinnedStager
from .walk import Extension, name

__all__ = ["CheckpointStager"]


class CheckpointStager(PinnedStager):  # pylint: disable=missing-class-docstring
    __doc__ = (
        PinnedStager.__doc__
        + """
    The optimizer part can be a snapshot that the stager takes (:meth:`optimizer_snapshot`)
    instead of an export: no ``state_dict_cpu_offload`` wait, the states copied into buffers
    kept like the rest. :meth:`close` frees the buffers and empties PyTorch's cache of
    pinned memory, giving the host memory back.
    """
    )

    def __init__(self, *, async_staging=False):
        super().__init__(async_staging=async_staging)
        # optimizer -> the handle of its step pre-hook; neither keeps the other alive
        self._hooks = weakref.WeakKeyDictionary()

    def optimizer_snapshot(self, model, optimizer, *, options=None):
        """What ``get_optimizer_state_dict(model, optimizer, options=options)`` returns for a
        TE ``FusedAdam``, taken by this stager when ``dcp.async_save`` stages it, without the
        export's wait: put it in the state dict in place of that.

        At ``stage()``, once the rest of the state dict's copies are enqueued, the stager
        copies each state's own bytes (BF16, FP32 or int16; FP16 and FP8 states unscaled to
        FP32 on the GPU by ``FusedAdam.get_unscaled_state``, one state at a time) into pinned
        FP32 (int16) buffers that it keeps, on its side stream; the BF16 ones are converted to
        FP32 in place once copied: bitwise what ``FusedAdam.state_dict()`` exports, as CPU
        tensors (CPU DTensors for DTensor parameters), with the param groups staged as the
        rest of the state dict is. Until the copies are done, ``optimizer.step()`` makes the
        GPU wait for them (a step pre-hook; the CPU does not wait). That hook covers
        ``step()`` of this optimizer only (not a step replayed from a CUDA graph): anything
        else that changes the optimizer's states on another stream or thread must wait for
        ``staging_completion`` first, and so must capturing a CUDA graph, and a step pre-hook
        that changes them and runs before the stager's (the global ones, and those of this
        optimizer registered before its first staging: hooks run in that order). Do not wait for
        ``staging_completion`` before ``optimizer.step()`` itself: it also covers the
        conversion on the CPU. :meth:`close` removes the hook (called from another thread
        than the training's, it leaves a hook that does nothing).

        Arguments:
            model (torch.nn.Module): as for ``get_optimizer_state_dict``; not FSDP1.
            optimizer (FusedAdam): a TE ``FusedAdam`` (whose ``state_dict()`` neither a
                subclass nor the object itself replaces) that has taken a step (in
                :meth:`load_template`, one without states gets them as
                ``get_optimizer_state_dict`` makes them).
            options (StateDictOptions, optional): as for ``get_optimizer_state_dict``, but
                not ``full_state_dict`` (it would gather values not copied yet); leave
                ``cpu_offload`` off (the stager copies).

        Host memory: 4 bytes per state element (int16 remainders 2) per process, kept until
        :meth:`close`; GPU memory: none for BF16, FP32 and int16 states, the FP32 copy of one
        state at a time for FP16 and FP8 ones. The snapshot is for this stager's ``stage()``
        only: pickling or deep-copying it raises a TypeError, and so does another stager.
        """
        if self._closed:
            raise RuntimeError(
                "CheckpointStager.optimizer_snapshot() called after close(); make a new stager"
            )
        _refuse(model, optimizer, options)
        return _OptimizerSnapshot(self, model, optimizer, options)

    def _close_extensions(self):
        # Removed only from the thread that staged (the training's): from another, it could
        # change the optimizer's hooks while a step goes through them. Left, a hook of a
        # closed stager does nothing.
        if self._owner in (None, threading.current_thread()):
            for handle in list(self._hooks.values()):
                handle.remove()
            self._hooks.clear()


class _OptimizerSnapshot(Extension):
    """What CheckpointStager.optimizer_snapshot() returns, for that stager's stage()."""

    what = "what CheckpointStager.optimizer_snapshot() returns"

    def __init__(self, stager, model, optimizer, options):
        self.stager, self.model, self.optimizer, self.options = stager, model, optimizer, options

    def stage_in(self, walk, path):
        """The optimizer state dict, its states in buffers that the side stream fills."""
        stager, optimizer = walk.stager, self.optimizer
        if self.stager is not stager:
            raise TypeError(
                "an optimizer_snapshot() of another CheckpointStager: pass it to the stager "
                "whose optimizer_snapshot() made it"
            )
        _refuse(self.model, optimizer, self.options)  # again: they may have changed since
        if not optimizer.state:
            if walk.mode != "template":
                raise RuntimeError(
                    "CheckpointStager.optimizer_snapshot(): the optimizer has no states yet "
                    "(before its first step)"
                )
            _make_states(optimizer)
        if walk.mode == "stage" and optimizer not in stager._hooks:
            hook = functools.partial(_wait_for_copies, weakref.ref(stager))
            stager._hooks[optimizer] = optimizer.register_step_pre_hook(hook)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        saved = torch.optim.Optimizer.state_dict(optimizer)  # indices and param_groups
        exports = {
            index: {
                key: _export(walk, optimizer, params[index], key, (*path, index, key))
                for key in keys
            }
            for index, keys in saved["state"].items()
        }
        # DCP maps the indices to names as it does FusedAdam.state_dict()'s, given a stand-in
        # of the optimizer (its attributes shared) whose state_dict() gives the exports: the
        # optimizer itself is not changed, for another thread that calls its state_dict().
        stand_in = object.__new__(type(optimizer))
        vars(stand_in).update(vars(optimizer))
        stand_in.state_dict = lambda: dict(saved, state=exports)
        state_dict = get_optimizer_state_dict(
            self.model, stand_in, options=self.options or StateDictOptions()
        )
        # The param groups as the rest of a state dict (capturable's GPU step and lr copied
        # on the side stream, CPU tensors at once); the states are in the walk's own buffers.
        return walk.value(state_dict, path)


def _refuse(model, optimizer, options):
    """Raise for what the snapshot would not follow: at optimizer_snapshot(), and again when
    it is staged, since the optimizer, its class or the options may change in between."""
    if options is not None and options.full_state_dict:
        raise ValueError(
            "CheckpointStager.optimizer_snapshot() does not take full_state_dict: it "
            "would gather states that are not copied yet"
        )
    # The first class to define get_unscaled_state(): a subclass of it may not change
    # state_dict(), whatever else it overrides.
    fused_adam = next(
        (c for c in reversed(type(optimizer).__mro__) if "get_unscaled_state" in vars(c)), None
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
    if "state_dict" in vars(optimizer):  # a wrapper set on the object itself
        raise TypeError(
            "CheckpointStager.optimizer_snapshot(): the optimizer's state_dict is replaced on "
            "the object, which the snapshot would not follow"
        )
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise ValueError(
            "CheckpointStager.optimizer_snapshot() does not take FSDP1 models (their "
            "optimizer state dict reshapes the states); use fully_shard (FSDP2)"
        )


def _export(walk, optimizer, param, key, path):
    """A buffer (in a DTensor for a DTensor `param`) that holds FusedAdam's export of the
    state `key` of `param` once the side stream's copies are done (BF16: and widened); the
    copy is enqueued after the walk (walk.deferred)."""
    local = param._local_tensor if isinstance(param, DTensor) else param
    walk.use_device(local.device, path)
    bf16 = optimizer.name_to_dtype_map[key] == torch.bfloat16
    raw = optimizer.state[param][key]
    dtype = torch.int16 if raw.dtype == torch.int16 else torch.float32
    buffer = walk.buffer(path, local.shape, dtype)
    walk.deferred.append(functools.partial(_copy_state, optimizer, param, key, path, buffer, bf16))
    walk.own.add(buffer.untyped_storage().data_ptr())  # the walk passes it through
    if not isinstance(param, DTensor):
        return buffer
    # The spec of the parameter with the export's dtype, as FusedAdam.state_dict() makes it.
    meta = param._spec.tensor_meta._replace(dtype=dtype)
    spec = dataclasses.replace(param._spec, tensor_meta=meta)
    return DTensor(buffer, spec, requires_grad=False)


def _copy_state(optimizer, param, key, path, buffer, bf16, walk, stream):
    """Enqueue the copy of the state into the end of `buffer` (all of it unless BF16)."""
    with torch.cuda.stream(stream):
        # BF16 as it is (skip_unscale: widened on the host); FP16 and FP8 unscaled to FP32,
        # FP32 and int16 as they are.
        value = optimizer.get_unscaled_state(param, key, skip_unscale=bf16)
        expected = torch.bfloat16 if bf16 else buffer.dtype  # FP32, or int16 remainders
        if value.dtype != expected or value.shape != buffer.shape:
            raise RuntimeError(
                "CheckpointStager.optimizer_snapshot(): get_unscaled_state() gave "
                f"{value.dtype} {tuple(value.shape)} for {name(path)}, a buffer of "
                f"{buffer.dtype} {tuple(buffer.shape)}"
            )
        if not value.is_contiguous():
            raise RuntimeError(
                "CheckpointStager.optimizer_snapshot() needs contiguous states; "
                f"{name(path)} has stride {value.stride()}"
            )
        start = buffer.nbytes - value.nbytes
        dst = buffer.view(-1).view(torch.uint8)[start:].view(value.dtype)
        walk.stager._copy_on(stream, [(dst, value.view(-1))])  # as the model's copies
        if bf16:
            widen = functools.partial(_widen, buffer, value.dtype)
            walk.finish.append((stream.record_event(), widen))


def _widen(buffer, dtype):
    widening.widen(buffer, dtype)  # looked up at the call: a test may replace it


def _make_states(optimizer):
    """The optimizer's states, made as get_optimizer_state_dict() makes them (DCP's own
    _init_optim_state: a step with zero gradients and learning rates)."""
    # pylint: disable-next=import-outside-toplevel
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    _init_optim_state(optimizer)
    if not optimizer.state:  # it does nothing where a parameter has a gradient already
        raise RuntimeError(
            "CheckpointStager.load_template(): the optimizer has no states, and DCP's "
            "initialization made none (a parameter has a .grad: call "
            "optimizer.zero_grad(set_to_none=True) first)"
        )


def _wait_for_copies(stager_ref, optimizer, args, kwargs):  # pylint: disable=unused-argument
    """Step pre-hook of optimizer_snapshot(): the step's work waits on the GPU for the
    copies of the stager's last staging while they are not done."""
    stager = stager_ref()
    copies = None if stager is None else stager._copies
    if copies is None:
        return
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "optimizer.step() captured in a CUDA graph while the copies of a "
            "CheckpointStager.optimizer_snapshot() are not done; wait for its "
            "staging_completion before capturing"
        )
    device, event = copies
    torch.cuda.current_stream(device).wait_event(event)
