"""CPU checks of te_fusedadam_offload.staging.CheckpointStager (the GPU tests, with TE, FSDP2
and DCP on disk, are in tests/staging/). Where the stager's logic does not need a GPU, a
stand-in treats marked CPU tensors as the GPU's: it copies them into buffers as the stager
copies CUDA tensors into pinned ones."""

import collections
import copy
import ctypes
import dataclasses
import gc
import io
import os
import pickle
import struct
import subprocess
import sys
import threading
import time
import weakref
import zipfile

import pytest
from support import EXIT_WITHOUT_FINALIZING, REPO

torch = pytest.importorskip("torch")

# DCP's note that a save or load without a process group is of one process: as meant here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# pylint: disable=wrong-import-position
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
)
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from te_fusedadam_offload.staging import CheckpointStager, ParallelFileSystemReader, widening
from te_fusedadam_offload.staging import buffers as buffers_module
from te_fusedadam_offload.staging import reader as reader_module
from te_fusedadam_offload.staging import snapshot as snapshot_module
from te_fusedadam_offload.staging import stager as stager_module

sys.path.insert(0, str(REPO / "tests" / "staging"))
# pylint: disable=wrong-import-order
from slow_storage import SlowWriter
from stand_in import StandIn, on_gpu, snapshot_stand_in


def test_cpu_tensors_are_copied_unless_private_and_other_values_deep_copied():
    """A CPU tensor is copied (a live one, such as torch's AdamW step, would be read as the
    upload reaches it); inside private() it is passed through; other values are copied."""
    step, export = torch.tensor(5.0), torch.arange(6, dtype=torch.float32)
    groups = [{"lr": 1e-4, "params": ["a", "b"]}]
    state = {
        "optim": {"state": {"a": {"step": step}}, "param_groups": groups},
        "export": CheckpointStager.private({"exp_avg": export}),
        "step": 3,
    }
    stager = CheckpointStager()
    staged = stager.stage(state)
    step.add_(1)  # the optimizer's next step, once stage() has returned
    assert torch.equal(staged["optim"]["state"]["a"]["step"], torch.tensor(5.0))
    assert staged["export"]["exp_avg"] is export  # no copy of a private copy
    assert staged["optim"]["param_groups"] == groups
    assert staged["optim"]["param_groups"] is not groups  # plain values: copied
    assert staged["optim"]["param_groups"][0]["params"] is not groups[0]["params"]
    assert staged["step"] == 3
    assert stager.cached_bytes() == step.nbytes
    stager.close()


def test_async_staging_without_gpu_tensors_gives_a_done_future_of_copies():
    stager = CheckpointStager(async_staging=True)
    x = torch.ones(2)
    future = stager.stage({"x": x})
    x.add_(1)
    assert future.done() and torch.equal(future.result()["x"], torch.ones(2))
    stager.close()


def test_other_devices_are_refused():
    stager = CheckpointStager()
    with pytest.raises(RuntimeError, match="model/w is on meta"):
        stager.stage({"model": {"w": torch.empty(2, device="meta")}})


class QuantizedTensor(torch.Tensor):
    """Named as TE's base class of FP8 tensors, which the stager recognizes by name."""


class ShardedTensor(torch.Tensor):
    """Named as torch's (FSDP1's sharded state dicts)."""


class Other(torch.Tensor):
    pass


@pytest.mark.parametrize(
    "kind, match",
    [
        (QuantizedTensor, "is a QuantizedTensor: TE's quantized weights"),
        (ShardedTensor, "is a ShardedTensor: FSDP1's sharded state dicts"),
        (Other, "is a Other: convert it to a plain tensor first"),
        ("sparse", "has layout torch.sparse_coo"),
    ],
)
def test_tensor_subclasses_and_other_layouts_are_refused_mid_walk_without_a_trace(kind, match):
    """A subclass would be copied as its nominal dtype (TE's FP8 saved dequantized) or, a
    ShardedTensor, passed through: refused, in the middle of the walk, before any copy is
    enqueued; the stager is idle, its buffers are whole, and the next staging works."""
    weight = on_gpu(torch.arange(8.0))
    stager = StandIn(async_staging=True)
    first = stager.stage({"w": weight}).result()["w"]
    pointers = stager._buffers.pointers()
    del first
    odd = torch.ones(2).to_sparse() if kind == "sparse" else torch.ones(2).as_subclass(kind)
    enqueued = stager._stream.enqueued
    with pytest.raises(TypeError, match=match):
        stager.stage({"w": weight, "odd": odd, "z": on_gpu(torch.zeros(3))})
    assert stager._stream.enqueued == enqueued and stager._copies is None
    weight.add_(1)
    staged = stager.stage({"w": weight}).result()
    assert torch.equal(staged["w"], weight) and stager._buffers.pointers() == pointers
    assert stager.overlapping_stagings == 0
    stager.close()


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")  # deprecated, still there
def test_a_quantized_tensor_is_refused_with_a_type_error_by_stage_prepare_and_load_template():
    """A quantized tensor (torch.quantize_per_tensor) is a plain torch.Tensor of a strided
    layout, which the type checks let through: stage() then crashed in an internal assert of
    torch (a buffer of a quantized dtype has no quantizer), and so did prepare() and
    load_template(). Refused with the TypeError that says what to do, before any copy."""
    weight = on_gpu(torch.arange(8.0))
    quantized = torch.quantize_per_tensor(torch.randn(6), 0.1, 3, torch.qint8)
    stager = StandIn()
    calls = (stager.stage, stager.prepare, stager.load_template)
    for call in calls:
        with pytest.raises(TypeError, match="model/q is quantized .*dequantize"):
            call({"w": weight, "model": {"q": quantized}})
    assert stager._copies is None
    assert torch.equal(stager.stage({"w": weight})["w"], weight)
    stager.close()


def test_without_torch_the_import_says_what_is_missing():
    code = "import sys; sys.modules['torch'] = None; import te_fusedadam_offload.staging"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: te_fusedadam_offload.staging needs PyTorch"), last
    assert "pip install '<its checkout>[staging]'" in last


def _model(n=1 << 16):
    return on_gpu(torch.arange(n, dtype=torch.float32))


@pytest.mark.parametrize("async_staging", [False, True], ids=["sync", "async"])
def test_staged_buffers_are_written_when_staging_is_complete(async_staging):
    """The stand-in's side stream copies 0.2 s after stage(): what stage() returns (sync),
    or its future's result (async), holds the values at stage(), and the current stream was
    made to wait for the copies before anything after stage() (one event per staging)."""
    weight = _model()
    expected = weight.clone()
    stager = StandIn(async_staging=async_staging)
    staged = stager.stage({"w": weight})
    staged = staged.result() if async_staging else staged
    assert torch.equal(staged["w"], expected)
    assert len(stager.ordered) == 1
    stager.close()


def test_a_buffer_still_held_by_an_upload_is_not_reused():
    """A staging while the previous staged state dict is held (its upload not done) gets a
    new buffer and leaves the held one as it was; once dropped, the buffer is reused."""
    weight = _model()
    stager = StandIn()
    first = stager.stage({"model": {"w": weight}})
    kept = first["model"]["w"].clone()
    weight.add_(1)
    second = stager.stage({"model": {"w": weight}})
    assert torch.equal(first["model"]["w"], kept)  # was overwritten before
    assert torch.equal(second["model"]["w"], weight)
    assert second["model"]["w"].data_ptr() != first["model"]["w"].data_ptr()
    assert stager.overlapping_stagings == 1
    ptr = second["model"]["w"].data_ptr()
    del first, second
    third = stager.stage({"model": {"w": weight}})
    assert third["model"]["w"].data_ptr() == ptr and stager.overlapping_stagings == 1
    assert stager.cached_bytes() == weight.nbytes
    stager.close()


def _load(path, like):  # pylint: disable=unused-argument
    return _raw(path)["model"]["w"]


def _raw(path):
    """The checkpoint at `path` as it was written (DCP's own conversion to torch.save), not
    through a load into a template that could hide a difference."""
    dcp_to_torch_save(path, path / "raw.pt")
    return torch.load(path / "raw.pt", weights_only=True)


def test_overlapping_async_saves_with_a_slow_storage_each_write_their_own_values(tmp_path):
    """dcp.async_save with the stager, the storage slow (each upload waits 1 s before it
    reads the staged tensors), three checkpoints without waiting for the uploads, training
    between them: before, the second staging overwrote the buffers that the first upload was
    about to write (checkpoint 0 held checkpoint 2's values). Each now loads back its own."""
    weight = _model()
    stager = StandIn()
    uploads, expected = [], []
    for n in range(3):
        expected.append(weight.clone())
        writer = SlowWriter(tmp_path / f"ckpt-{n}", delay_s=1.0 if n < 2 else 0.0)
        state = {"model": {"w": weight}, "optim": {"exp_avg": torch.full((4,), float(n))}}
        uploads.append(
            dcp.async_save(state, storage_writer=writer, async_stager=stager, no_dist=True)
        )
        weight.add_(1000)  # training goes on at once
    assert not uploads[0].done()  # the later stagings happened while it was still to write
    for upload in uploads:
        upload.result()
    for n in range(3):
        assert torch.equal(_load(tmp_path / f"ckpt-{n}", weight), expected[n]), n
    assert stager.overlapping_stagings == 2
    # The uploads done, the next checkpoint reuses a buffer: no new one.
    pointers = stager._buffers.pointers()
    staged = stager.stage({"model": {"w": weight}})
    assert staged["model"]["w"].data_ptr() in pointers and stager.overlapping_stagings == 2
    assert torch.equal(staged["model"]["w"], weight)
    stager.close()


class _FullDisk(SlowWriter):
    def write_data(self, plan, planner):
        raise OSError(28, "No space left on device")


def test_a_failed_upload_kept_by_the_caller_does_not_hold_up_the_next_checkpoint(tmp_path):
    """A failed upload's future holds its staged state dict (in the exception's traceback)
    for as long as it is kept: the next checkpoint gets new buffers, neither waits nor fails."""
    weight = _model()
    stager = StandIn()
    failed = dcp.async_save(
        {"model": {"w": weight}},
        storage_writer=_FullDisk(tmp_path / "full", 0.0),
        async_stager=stager,
        no_dist=True,
    )
    with pytest.raises(BaseException, match="No space left on device"):  # CheckpointException
        failed.result()
    weight.add_(1)
    upload = dcp.async_save(
        {"model": {"w": weight}},
        storage_writer=SlowWriter(tmp_path / "ok", 0.0),
        async_stager=stager,
        no_dist=True,
    )
    upload.result()
    assert torch.equal(_load(tmp_path / "ok", weight), weight)
    assert stager.overlapping_stagings == 1  # `failed` is still referenced here
    stager.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize("n", [1, 3, 2**16, 2**16 + 1, 3 * 2**18 + 5])
def test_widen_in_place_is_bitwise_the_conversion(dtype, n):
    """The values copied into the end of an FP32 buffer, widened in place, are bitwise what
    converting them gives, for sizes below, at and above the pass threshold."""
    values = torch.randn(n).to(dtype)
    buffer = torch.full((n,), float("nan"))
    raw = buffer.view(torch.uint8)[buffer.nbytes - values.nbytes :].view(dtype)
    raw.copy_(values)
    widening.widen(buffer, dtype)
    assert torch.equal(buffer.view(torch.int32), values.float().view(torch.int32))


class FusedAdamLike(torch.optim.SGD):
    """What the snapshot asks of TE's FusedAdam before it stages anything."""

    def get_unscaled_state(self, param, state_name, skip_unscale=False):
        raise AssertionError("not called before stage()")


class FusedAdamWithItsOwnStateDict(FusedAdamLike):
    def state_dict(self):
        return dict(super().state_dict(), extra=1)


class FusedAdamWithItsOwnStateDictAndUnscaling(FusedAdamWithItsOwnStateDict):
    def get_unscaled_state(self, param, state_name, skip_unscale=False):
        raise AssertionError("not called before stage()")


def test_an_optimizer_snapshot_refuses_to_be_copied_or_misconfigured():
    """The snapshot is for its stager's stage(): pickling or deep-copying it (as dcp.save and
    other stagers do with values they do not know) raises; so do full_state_dict, an
    optimizer other than TE's FusedAdam, and a subclass (also one that overrides
    get_unscaled_state() as well) or an object whose state_dict() the snapshot would not follow."""
    stager = CheckpointStager()
    params = [torch.nn.Parameter(torch.zeros(2))]
    model = torch.nn.Linear(2, 2)
    snapshot = stager.optimizer_snapshot(model, FusedAdamLike(params, lr=0.1))
    with pytest.raises(TypeError, match="staged only by its CheckpointStager"):
        pickle.dumps(snapshot)
    with pytest.raises(TypeError, match="staged only by its CheckpointStager"):
        copy.deepcopy({"optim": snapshot})
    with pytest.raises(ValueError, match="full_state_dict"):
        stager.optimizer_snapshot(
            model, FusedAdamLike(params, lr=0.1), options=StateDictOptions(full_state_dict=True)
        )
    with pytest.raises(TypeError, match="takes a TE FusedAdam, got SGD"):
        stager.optimizer_snapshot(model, torch.optim.SGD(params, lr=0.1))
    with pytest.raises(TypeError, match="FusedAdamWithItsOwnStateDict overrides state_dict"):
        stager.optimizer_snapshot(model, FusedAdamWithItsOwnStateDict(params, lr=0.1))
    with pytest.raises(TypeError, match="StateDictAndUnscaling overrides state_dict"):
        stager.optimizer_snapshot(model, FusedAdamWithItsOwnStateDictAndUnscaling(params, lr=0.1))
    wrapped = FusedAdamLike(params, lr=0.1)
    export = wrapped.state_dict
    wrapped.state_dict = lambda: dict(export(), extra=1)  # as framework wrappers do
    with pytest.raises(TypeError, match="state_dict is replaced on the object"):
        stager.optimizer_snapshot(model, wrapped)
    stager.close()


@pytest.fixture
def stand_in_stream(monkeypatch):
    """What the snapshot does with its side stream on a GPU does nothing here."""
    snapshot_stand_in(monkeypatch)


class StandInFusedAdam(torch.optim.Optimizer):
    """The parts of TE's FusedAdam the snapshot uses, on CPU: BF16 moments, an FP32 master
    copy, get_unscaled_state() and name_to_dtype_map; state_dict() exports FP32 CPU tensors,
    as FusedAdam's does."""

    name_to_dtype_map = {
        "exp_avg": torch.bfloat16,
        "exp_avg_sq": torch.bfloat16,
        "master_param": torch.float32,
    }

    def __init__(self, params):
        super().__init__(params, {"lr": 0.1, "betas": (0.9, 0.99)})
        for group in self.param_groups:
            group["step"] = 3
            for p in group["params"]:
                self.state[p] = {
                    "exp_avg": torch.randn(p.shape).bfloat16(),
                    "exp_avg_sq": torch.rand(p.shape).bfloat16(),
                    "master_param": p.detach().float().clone(),
                }

    def step(self, closure=None):  # pylint: disable=unused-argument
        for states in self.state.values():
            for state in states.values():
                state.add_(1)

    def get_unscaled_state(self, param, state_name, skip_unscale=False):
        state = self.state[param][state_name]
        return state if skip_unscale or state.dtype != torch.bfloat16 else state.float()

    def state_dict(self):
        exported = super().state_dict()  # its "state" holds the optimizer's own dicts
        exported["state"] = {
            k: {name: t.float() for name, t in v.items()} for k, v in exported["state"].items()
        }
        return exported


def _same_export(got, expected):
    """`got` has the keys, param groups and state values (bitwise, dtypes) of `expected`,
    nested or flattened."""
    assert got.keys() == expected.keys()
    if "state" in expected:  # nested
        assert got["param_groups"] == expected["param_groups"]
        got, expected = _flat(got["state"]), _flat(expected["state"])
        assert got.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


def _flat(state):
    return {(fqn, name): t for fqn, states in state.items() for name, t in states.items()}


@pytest.mark.parametrize("flatten", [False, True], ids=["nested", "flat"])
@pytest.mark.parametrize("cpu_offload", [False, True], ids=["on_device", "cpu_offload"])
@pytest.mark.usefixtures("stand_in_stream")
def test_optimizer_snapshot_is_the_export_through_dcp_with_every_option(flatten, cpu_offload):
    """Through DCP's get_optimizer_state_dict with each option, the staged snapshot has the
    export's keys, param groups and values bitwise (BF16 states widened), in buffers that the
    next snapshot reuses; the step pre-hook is removed by close() and keeps neither the
    optimizer nor the stager alive."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 3))
    optimizer = StandInFusedAdam(model.parameters())
    options = StateDictOptions(flatten_optimizer_state_dict=flatten, cpu_offload=cpu_offload)
    expected = get_optimizer_state_dict(model, optimizer, options=options)
    stager = StandIn()
    hooks = len(optimizer._optimizer_step_pre_hooks)
    pointers = []
    for _ in range(2):
        staged = stager.stage(
            {"optim": stager.optimizer_snapshot(model, optimizer, options=options)}
        )
        _same_export(staged["optim"], expected)
        pointers.append(stager._buffers.pointers())
        del staged  # the buffers are free for the next snapshot
    assert pointers[0] == pointers[1]  # reused
    assert len(optimizer._optimizer_step_pre_hooks) == hooks + 1
    optimizer.step()  # the hook: nothing to wait for once the copies are done
    probe = weakref.ref(stager)
    del stager
    gc.collect()
    assert probe() is None  # the optimizer's hook does not keep the stager
    # It stays and does nothing: removed from the thread that drops the stager, it could
    # change the optimizer's hooks while a step goes through them.
    assert len(optimizer._optimizer_step_pre_hooks) == hooks + 1
    optimizer.step()
    stager = StandIn()
    stager.stage({"optim": stager.optimizer_snapshot(model, optimizer)})
    assert len(optimizer._optimizer_step_pre_hooks) == hooks + 2
    stager.close()  # from the thread that staged: removes its hook
    assert len(optimizer._optimizer_step_pre_hooks) == hooks + 1
    assert stager.cached_bytes() == 0
    probe = weakref.ref(optimizer)
    other = StandIn()
    other.stage({"optim": other.optimizer_snapshot(model, optimizer)})
    del optimizer
    gc.collect()
    assert probe() is None  # the stager does not keep the optimizer
    other.close()


class IntMasterFusedAdam(StandInFusedAdam):
    """get_unscaled_state() gives int16 for a master copy the export has in FP32."""

    def get_unscaled_state(self, param, state_name, skip_unscale=False):
        state = super().get_unscaled_state(param, state_name, skip_unscale)
        return state.to(torch.int16) if state_name == "master_param" else state


class WrappedFusedAdam(StandInFusedAdam):
    """A framework's wrapper class, set on an optimizer as its __class__."""

    def state_dict(self):
        return dict(super().state_dict(), extra=1)


def _wrap_state_dict(optimizer, options):
    export = optimizer.state_dict
    optimizer.state_dict = lambda: dict(export(), extra=1)


def _swap_class(optimizer, options):
    optimizer.__class__ = WrappedFusedAdam


def _full_state_dict(optimizer, options):
    options.full_state_dict = True


@pytest.mark.parametrize(
    "change, refusal",
    [
        (_wrap_state_dict, "state_dict is replaced on the object"),
        (_swap_class, "WrappedFusedAdam overrides state_dict"),
        (_full_state_dict, "does not take full_state_dict"),
    ],
    ids=["state_dict_on_the_object", "class", "full_state_dict"],
)
@pytest.mark.usefixtures("stand_in_stream")
def test_what_changes_after_the_snapshot_is_refused_at_stage(change, refusal):
    """What optimizer_snapshot() refuses is refused at stage() too when it comes after the
    snapshot was taken (a wrapper set on the object, a wrapper class, full_state_dict set on
    the options): before a copy, the change kept, nothing cached."""
    model = torch.nn.Linear(8, 4)
    optimizer = StandInFusedAdam(model.parameters())
    options = StateDictOptions()
    stager = StandIn()
    snapshot = stager.optimizer_snapshot(model, optimizer, options=options)
    change(optimizer, options)
    changed = dict(vars(optimizer)), type(optimizer)
    with pytest.raises((TypeError, ValueError), match=refusal):
        stager.stage({"optim": snapshot})
    assert (vars(optimizer), type(optimizer)) == changed
    assert stager.cached_bytes() == 0
    stager.close()


@pytest.mark.usefixtures("stand_in_stream")
def test_the_snapshot_leaves_the_optimizers_state_dict_as_it_is_while_it_stages(monkeypatch):
    """While DCP makes the snapshot's state dict, the optimizer's own state_dict() (another
    thread may call it) is FusedAdam's export, not the snapshot's buffers: DCP is given a
    stand-in of the optimizer."""
    model = torch.nn.Linear(8, 4)
    optimizer = StandInFusedAdam(model.parameters())
    expected = optimizer.state_dict()
    seen, dcp_own = [], snapshot_module.get_optimizer_state_dict

    def get_optimizer_state_dict(model, given, options):
        seen.append((given is optimizer, optimizer.state_dict()))
        return dcp_own(model, given, options=options)

    monkeypatch.setattr(snapshot_module, "get_optimizer_state_dict", get_optimizer_state_dict)
    stager = StandIn()
    staged = stager.stage({"optim": stager.optimizer_snapshot(model, optimizer)})
    ((given_itself, during),) = seen
    assert not given_itself and "state_dict" not in vars(optimizer)
    assert during.keys() == expected.keys() and during["param_groups"] == expected["param_groups"]
    for index, states in expected["state"].items():
        for key, value in states.items():
            assert torch.equal(during["state"][index][key], value), (index, key)
    assert staged["optim"]["state"].keys() == {"weight", "bias"}
    stager.close()


@pytest.mark.usefixtures("stand_in_stream")
def test_a_state_of_another_dtype_than_its_buffer_is_refused():
    """A state that get_unscaled_state() gives in another dtype than the export's (int16 for
    an FP32 buffer) raises instead of landing, as bytes, in a part of the buffer."""
    model = torch.nn.Linear(8, 4)
    stager = StandIn()
    snapshot = stager.optimizer_snapshot(model, IntMasterFusedAdam(model.parameters()))
    with pytest.raises(RuntimeError, match="gave torch.int16 .* a buffer of torch.float32"):
        stager.stage({"optim": snapshot})
    stager.close()


@pytest.mark.usefixtures("stand_in_stream")
def test_a_failed_widening_leaves_nothing_for_a_step_to_wait_for(monkeypatch):
    """The widening of a BF16 state raises: the staging raises it, the copies are waited for
    anyway, so that no later step waits (or refuses a capture), and the next staging runs."""
    model = torch.nn.Linear(8, 4)
    optimizer = StandInFusedAdam(model.parameters())
    stager = StandIn()

    def fails(buffer, dtype):
        raise MemoryError("injected")

    with monkeypatch.context() as patched:
        patched.setattr(widening, "widen", fails)
        with pytest.raises(MemoryError, match="injected"):
            stager.stage({"optim": stager.optimizer_snapshot(model, optimizer)})
    assert stager._copies is None and stager._pending is None
    expected = get_optimizer_state_dict(model, optimizer)
    _same_export(
        stager.stage({"optim": stager.optimizer_snapshot(model, optimizer)})["optim"], expected
    )
    stager.close()


def _adamw():
    """A CPU model and torch's AdamW with a tensor lr that a scheduler updates in place (fill_):
    its `step` states and its lr are live CPU tensors."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01), foreach=False)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return model, optimizer, scheduler


def _train(model, optimizer, scheduler):
    model(torch.randn(4, 16)).square().sum().backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def _cpu_copies(value):
    if isinstance(value, dict):
        return {k: _cpu_copies(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_cpu_copies(v) for v in value]
    return value.clone() if isinstance(value, torch.Tensor) else value


def _same(got, expected, path=()):
    """`got` (read back raw) is `expected` (the state at async_save): keys, dtypes, bits."""
    if isinstance(expected, dict):
        assert isinstance(got, dict) and got.keys() == expected.keys(), path
        for key, value in expected.items():
            _same(got[key], value, (*path, key))
    elif isinstance(expected, list):
        assert len(got) == len(expected), path
        for i, value in enumerate(expected):
            _same(got[i], value, (*path, i))
    elif isinstance(expected, torch.Tensor):
        assert got.dtype == expected.dtype and torch.equal(got, expected), path
    else:
        assert got == expected, path


@pytest.mark.parametrize("export", [False, True], ids=["state_dict", "optimizer_export"])
def test_live_cpu_tensors_are_saved_as_they_were_at_async_save(tmp_path, export):
    """torch's AdamW keeps its `step` on the CPU and increments it in place, and a scheduler
    fill_()s a tensor lr: both changed while the upload waits to write (before, the checkpoint
    held the new values). Read back raw, the checkpoint is the state at async_save; through
    optimizer_export() too, which copies what shares memory with the optimizer."""
    model, optimizer, scheduler = _adamw()
    for _ in range(5):
        _train(model, optimizer, scheduler)
    stager = CheckpointStager(async_staging=True)
    optim = (
        stager.optimizer_export(model, optimizer)
        if export
        else get_optimizer_state_dict(model, optimizer)
    )
    state = {"model": model.state_dict(), "optim": optim}
    expected = _cpu_copies(
        {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, optimizer)}
    )
    writer = SlowWriter(tmp_path / "ckpt", delay_s=0.5)
    upload = dcp.async_save(state, storage_writer=writer, async_stager=stager, no_dist=True)
    del state, optim
    for _ in range(3):  # at once, as the recipe allows once staging_completion is done
        upload.staging_completion.result()
        _train(model, optimizer, scheduler)
    assert not upload.upload_completion.done()
    upload.upload_completion.result()
    assert optimizer.state[model.weight]["step"] == 8 and optimizer.param_groups[0]["lr"] < 0.01
    _same(_raw(tmp_path / "ckpt"), expected)
    stager.close()


def test_optimizer_export_passes_through_only_what_shares_no_memory():
    """Of an export, the CPU tensors made for it are passed through; those that are the
    optimizer's own (torch's AdamW without cpu_offload: every state; FusedAdam's FP32 master
    copy, returned as it is) are copied."""
    model, optimizer, scheduler = _adamw()
    _train(model, optimizer, scheduler)
    stager = CheckpointStager()
    staged = stager.stage({"optim": stager.optimizer_export(model, optimizer)})
    live = optimizer.state[model.weight]
    for key, value in staged["optim"]["state"]["weight"].items():
        assert value is not live[key] and torch.equal(value, live[key]), key
    model = torch.nn.Linear(8, 4)
    adam = StandInFusedAdam(model.parameters())
    export = stager.optimizer_export(model, adam)
    staged = stager.stage({"optim": export})
    for key, value in staged["optim"]["state"]["weight"].items():
        made = export.value["state"]["weight"][key]
        assert (value is made) == (key != "master_param"), key
        assert torch.equal(value, adam.state[model.weight][key].float()), key
    stager.close()


def test_optimizer_export_copies_a_tensor_that_reaches_the_optimizers_memory_by_another_storage():
    """A CPU tensor of the export that reaches a live state's memory through a storage of its
    own (``torch.frombuffer`` of the memory of its last rows) starts at another address than
    the state's storage: told by the storage's address alone, it was passed through, and the
    upload would read it while the next step changes it. Now any overlap of memory copies it."""

    class Aliasing(torch.optim.SGD):
        """An optimizer whose export gives its live momentum's last rows by another storage."""

        def state_dict(self):
            state_dict = super().state_dict()  # its states' dicts are the live ones: copied
            state_dict["state"] = {k: dict(v) for k, v in state_dict["state"].items()}
            for state in state_dict["state"].values():
                live = state["momentum_buffer"]
                rows = (ctypes.c_float * live[1:].numel()).from_address(live[1:].data_ptr())
                state["momentum_buffer"] = torch.frombuffer(rows, dtype=torch.float32).view(3, 4)
            return state_dict

    model = torch.nn.Linear(4, 4, bias=False)
    optimizer = Aliasing(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    stager = CheckpointStager()
    export = stager.optimizer_export(model, optimizer)
    exported = export.value["state"]["weight"]["momentum_buffer"]
    live = optimizer.state[model.weight]["momentum_buffer"]
    assert exported.untyped_storage().data_ptr() != live.untyped_storage().data_ptr()
    staged = stager.stage({"optim": export})["optim"]["state"]["weight"]["momentum_buffer"]
    assert staged is not exported and torch.equal(staged, live[1:])
    live.add_(1.0)  # the next step
    assert not torch.equal(staged, live[1:])
    stager.close()


# The lifecycle: interrupts, close() from a callback, a device that never finishes.


def test_an_interrupt_as_the_staging_thread_starts_leaves_the_stager_usable(monkeypatch):
    """A KeyboardInterrupt (or any exception) as stage() starts its thread: before, the
    stager refused every later stage() and close() blocked forever. Now the staging is
    undone, the next one works and close() returns."""
    weight = _model()
    stager = StandIn(async_staging=True)

    def interrupted(thread):  # pylint: disable=unused-argument
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(threading.Thread, "start", interrupted)
        with pytest.raises(KeyboardInterrupt):
            stager.stage({"w": weight})
    assert torch.equal(stager.stage({"w": weight}).result()["w"], weight)
    closing = threading.Thread(target=stager.close, daemon=True)
    closing.start()
    closing.join(timeout=10)
    assert not closing.is_alive()


def test_close_from_a_staging_completion_callback(tmp_path):
    """close() in a callback of staging_completion runs in the stager's own thread: before,
    it tried to join that thread (and failed); now it closes, and the upload is whole."""
    weight = _model()
    expected = weight.clone()
    stager = StandIn(async_staging=True, delay_s=0.5)
    outcome = []

    def close(_):
        try:
            stager.close()
            outcome.append("closed")
        except BaseException as exc:  # pylint: disable=broad-exception-caught
            outcome.append(exc)

    upload = dcp.async_save(
        {"model": {"w": weight}},
        storage_writer=SlowWriter(tmp_path / "ckpt", 0.0),
        async_stager=stager,
        no_dist=True,
    )
    assert not upload.staging_completion.done()
    upload.staging_completion.add_done_callback(close)
    upload.upload_completion.result()
    assert outcome == ["closed"]
    assert torch.equal(_raw(tmp_path / "ckpt")["model"]["w"], expected)
    with pytest.raises(RuntimeError, match="after close"):
        stager.stage({"w": weight})


_EXIT = """
import sys, threading; sys.path.insert(0, 'tests/staging')
import torch, torch.distributed.checkpoint as dcp
from stand_in import StandIn, on_gpu
from te_fusedadam_offload.staging import stager as stager_module
stager_module.EXIT_WAIT_S = 2.0
stager = StandIn(async_staging=True, delay_s={delay_s}, hold={hold})
upload = dcp.async_save({{'model': {{'w': on_gpu(torch.arange(4.0))}}}}, checkpoint_id={path!r},
                        async_stager=stager, no_dist=True)
assert not upload.staging_completion.done()
print('staged', flush=True)
"""


def test_a_staging_that_never_completes_does_not_keep_the_interpreter_from_exiting(tmp_path):
    """A hung device: the copies never end, and the script ends after dcp.async_save. DCP's
    upload thread (not a daemon, joined at exit) waits for the staging with no timeout:
    before, the process never exited. Now the stager fails the staging at exit once it has
    waited EXIT_WAIT_S for it (a warning says so), the upload fails, and the process exits
    without writing the checkpoint."""
    code = _EXIT.format(delay_s=0.0, hold="threading.Event()", path=str(tmp_path / "ckpt"))
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and result.stdout == "staged\n", result.stderr
    assert "a staging not complete after 2.0 s" in result.stderr, result.stderr
    assert not (tmp_path / "ckpt" / ".metadata").exists()


def test_the_exit_hook_fails_a_hung_staging_and_lets_other_uploads_finish_under_w_error(
    tmp_path,
):
    """With warnings made errors (-W error, as CI often runs): before, the hook's warning
    raised before it failed the hung staging, and a hook that raises stops the interpreter's
    other exit hooks, among them the join of other uploads still running: a healthy one was
    cut off unwritten. Now the staging is failed first and the message goes to stderr."""
    marker = tmp_path / "healthy"
    code = _EXIT.format(delay_s=0.0, hold="threading.Event()", path=str(tmp_path / "ckpt"))
    code += (
        "import concurrent.futures, pathlib, time\n"
        "def healthy():\n"
        f"    time.sleep(3); pathlib.Path({str(marker)!r}).write_text('ok')\n"
        "concurrent.futures.ThreadPoolExecutor(1).submit(healthy)\n"
    )
    result = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0 and result.stdout == "staged\n", result.stderr
    assert "a staging not complete after 2.0 s" in result.stderr, result.stderr
    assert marker.read_text() == "ok"
    assert not (tmp_path / "ckpt" / ".metadata").exists()


def test_a_staging_still_running_at_exit_is_waited_for_and_written(tmp_path):
    """A script that ends right after dcp.async_save, its copies taking 1 s: the exit waits
    for the staging (within EXIT_WAIT_S), and the checkpoint is written, as DCP's own
    staging would have it."""
    code = _EXIT.format(delay_s=1.0, hold=None, path=str(tmp_path / "ckpt"))
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and result.stdout == "staged\n", result.stderr
    assert "not complete" not in result.stderr, result.stderr
    assert torch.equal(_raw(tmp_path / "ckpt")["model"]["w"], torch.arange(4.0))


_PROCESS = """
import os, sys
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import _async_process_executor as executor
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from te_fusedadam_offload.staging import CheckpointStager
path, rank = sys.argv[1], int(os.environ["RANK"])
dist.init_process_group("gloo", init_method=f"file://{path}/store", rank=rank,
                        world_size=int(os.environ["WORLD_SIZE"]))
stager = CheckpointStager()
weight = torch.arange(8.0) + 100 * rank
state = {"model": {f"w{rank}": weight}, "optim": stager.private({f"m{rank}": -weight})}
try:
    dcp.async_save(state, checkpoint_id=f"{path}/process", async_stager=stager,
                   async_checkpointer_type=AsyncCheckpointerType.PROCESS).result()
    print("written")
except ValueError as exc:
    print("refused:", exc)
print("checkpoint process:", executor._CHECKPOINT_PROCESS is not None)
print("bytes copied:", stager.cached_bytes())
dcp.async_save(state, checkpoint_id=f"{path}/thread", async_stager=stager,
               async_checkpointer_type=AsyncCheckpointerType.THREAD).result()
stager.close()
dist.destroy_process_group()
"""
_PROCESS += EXIT_WITHOUT_FINALIZING


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_process_checkpointer_is_refused_at_async_save_and_the_thread_one_writes(
    tmp_path, world_size
):
    """dcp.async_save(..., async_checkpointer_type=AsyncCheckpointerType.PROCESS) with the
    stager, ranks on gloo. Before, it ran: DCP's checkpoint process wrote the right values,
    but pickling them to it moved each staged tensor into new shared memory, the stager's
    pinned buffers too (pinned no more after the first checkpoint) and the passed-through
    ones at every checkpoint. Now every rank refuses at the call, before a copy, a
    checkpoint process or a file, and the stager then saves with the thread checkpointer."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", WORLD_SIZE=str(world_size))
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", _PROCESS, str(tmp_path)],
            cwd=REPO,
            env=dict(env, RANK=str(rank)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world_size)
    ]
    try:
        outputs = [rank.communicate(timeout=120) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    for rank, (out, err) in zip(ranks, outputs):
        assert rank.returncode == 0, err
        refusal, *facts = out.splitlines()
        assert refusal.startswith("refused: CheckpointStager does not stage for DCP's checkpoint")
        assert refusal.endswith(
            "Use the thread checkpointer, async_save's default: AsyncCheckpointerType.THREAD"
        ), refusal
        assert facts == ["checkpoint process: False", "bytes copied: 0"], out
    assert not (tmp_path / "process").exists()
    weights = [torch.arange(8.0) + 100 * rank for rank in range(world_size)]
    expected = {
        "model": {f"w{rank}": w for rank, w in enumerate(weights)},
        "optim": {f"m{rank}": -w for rank, w in enumerate(weights)},
    }
    _same(_raw(tmp_path / "thread"), expected)


@pytest.mark.parametrize("async_staging", [False, True], ids=["sync", "async"])
def test_staging_a_parameter_records_no_autograd_history(async_staging):
    """stage() copies parameters (requires_grad) with autograd off: before, each kept buffer
    became a non-leaf whose grad_fn chain grew by one per checkpoint, and a backward through
    the staged copy wrote into the live parameter's .grad."""
    cpu = torch.nn.Parameter(torch.ones(3))
    gpu = on_gpu(torch.nn.Parameter(torch.arange(4.0)))
    stager = StandIn(async_staging=async_staging)
    for _ in range(3):
        staged = stager.stage({"cpu": cpu, "gpu": gpu})
        staged = staged.result() if async_staging else staged
        for key in ("cpu", "gpu"):
            assert not staged[key].requires_grad and staged[key].grad_fn is None, key
        del staged
    for buffer, _ in stager._buffers._entries.values():
        assert buffer.is_leaf and not buffer.requires_grad and buffer.grad_fn is None
    assert cpu.grad is None and gpu.grad is None
    stager.close()


def test_synchronize_staging_returns_only_once_the_staging_is_complete(monkeypatch):
    """The staging's thread completes its future slowly (its set_result held back): before,
    it dropped the future first, so that synchronize_staging() returned while the staging
    was not complete."""
    entered = threading.Event()

    class SlowFuture(stager_module.Future):
        def set_result(self, result):
            entered.set()
            time.sleep(0.3)
            super().set_result(result)

    monkeypatch.setattr(stager_module, "Future", SlowFuture)
    stager = StandIn(async_staging=True, delay_s=0.0)
    future = stager.stage({"w": _model()})
    assert entered.wait(10)
    stager.synchronize_staging()
    assert future.done() and stager._pending is None
    stager.close()


_SIGNAL_CLOSE = """
import signal, sys, torch
sys.path.insert(0, 'tests/staging')
from stand_in import StandIn, on_gpu
stager = StandIn(async_staging={async_staging})

def on_term(*_):  # a preemption handler
    stager.close()
    print('closed in the handler', flush=True)
    if {exits}:
        sys.exit(3)

signal.signal(signal.SIGTERM, on_term)

class Preempted:
    def __deepcopy__(self, memo):  # the handler runs at the next bytecode: inside stage()
        signal.raise_signal(signal.SIGTERM)
        return 0

w = on_gpu(torch.arange(4.0))
try:
    staged = stager.stage({{'w': w, 'p': Preempted(), 'x': torch.ones(2)}})
except SystemExit as exc:
    print('exit', exc.code, stager.cached_bytes(), stager._pending, flush=True)
    raise
staged = staged.result() if {async_staging} else staged
assert torch.equal(staged['w'], torch.arange(4.0)) and staged['p'] == 0, staged
print('staged', stager.cached_bytes(), stager._pending, flush=True)
try:
    stager.stage({{'w': w}})
except RuntimeError as exc:
    print(exc)
"""


@pytest.mark.parametrize("exits", [True, False], ids=["exits", "returns"])
@pytest.mark.parametrize("async_staging", [False, True], ids=["sync", "async"])
def test_close_from_a_signal_handler_during_stage(async_staging, exits):
    """A preemption handler calls close() while stage() runs in the thread it interrupted:
    before, close() waited forever for the lock that stage() held. Now it marks the stager
    closed and returns; stage() frees the buffers at its end (once its copies are done),
    whether the handler exits (SystemExit through stage()) or returns (stage() returns what
    it staged, and the stager stages no more)."""
    code = _SIGNAL_CLOSE.format(async_staging=async_staging, exits=exits)
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    if exits:
        assert result.returncode == 3, result.stderr
        assert result.stdout == "closed in the handler\nexit 3 0 None\n", result.stderr
    else:
        assert result.returncode == 0, result.stderr
        assert (
            result.stdout
            == "closed in the handler\nstaged 0 None\n"
            "CheckpointStager.stage() called after close()\n"
        ), result.stderr


def test_optimizer_export_copies_live_tensors_nested_in_param_groups_and_states():
    """torch's Adam with betas=(tensor, tensor): the live tensors sit in a tuple of a param
    group (and a state may nest them in a dict). Before, optimizer_export() looked one level
    deep only and passed them through: a change after stage() reached the checkpoint."""
    model = torch.nn.Linear(2, 2)
    beta1, beta2 = torch.tensor(0.9), torch.tensor(0.999)
    optimizer = torch.optim.Adam(model.parameters(), betas=(beta1, beta2))
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    extra = torch.tensor([1.0, 2.0])
    optimizer.state[model.weight]["extra"] = {"nested": [extra]}
    stager = CheckpointStager()
    staged = stager.stage({"optim": stager.optimizer_export(model, optimizer)})
    beta1.fill_(0.5)  # changed after stage(), before the upload writes
    extra.add_(1)
    assert staged["optim"]["param_groups"][0]["betas"][0].item() == pytest.approx(0.9)
    assert staged["optim"]["param_groups"][0]["betas"][1] is not beta2
    nested = staged["optim"]["state"]["weight"]["extra"]["nested"][0]
    assert torch.equal(nested, torch.tensor([1.0, 2.0]))
    stager.close()


class _Config:
    """An object DCP would pickle whole."""

    def __init__(self, value):
        self.value = value


def test_tensors_in_namedtuples_are_staged_and_in_other_objects_refused():
    """Only dicts, lists and tuples were walked; other containers were deep-copied past the
    stager's rules (a subclass tensor in a namedtuple hit torch's deepcopy error; a GPU tensor
    in one was cloned on the GPU). Namedtuples are now walked like tuples, and a tensor inside
    any other object is refused with a TypeError; objects without tensors are deep-copied."""
    pair = collections.namedtuple("Pair", "w s")
    weight = on_gpu(torch.arange(4.0))
    stager = StandIn()
    staged = stager.stage({"p": pair(weight, 1), "c": _Config([1, 2])})
    assert type(staged["p"]) is pair and staged["p"].s == 1
    assert torch.equal(staged["p"].w, weight) and staged["p"].w is not weight
    assert staged["c"] is not None and staged["c"].value == [1, 2]
    with pytest.raises(TypeError, match="p/0 is a QuantizedTensor"):
        stager.stage({"p": pair(torch.ones(2).as_subclass(QuantizedTensor), 1)})
    for odd in (_Config(weight), {torch.ones(1)}):
        with pytest.raises(TypeError, match="x/y is a .* that holds a tensor"):
            stager.stage({"x": {"y": odd}})
    stager.close()


class _Hooked:
    """An object that pickling stops at before it reaches its tensor (a module with a
    lambda hook is one)."""

    def __init__(self, value):
        self.hook = lambda: None
        self.value = value


def test_an_object_that_cannot_be_pickled_is_refused_not_deep_copied_past_the_rules():
    """Whether an object holds a tensor is found by pickling it; a pickling that failed
    (here at a lambda, before the tensor) counted as "no tensor", and the object was
    deep-copied: its GPU tensor cloned on the GPU in stage() and prepare() (which refuse an
    object that holds a tensor), the object copied into a load template. It is refused with
    a TypeError that says why, as DCP, which pickles it to save it, would fail."""
    stager = StandIn()
    weight = on_gpu(torch.arange(4.0))
    calls = (stager.stage, stager.prepare, stager.load_template)
    for call in calls:
        with pytest.raises(TypeError, match="x/y is a _Hooked that cannot be pickled"):
            call({"w": weight, "x": {"y": _Hooked(weight)}})
        with pytest.raises(TypeError, match="x/y is a _Hooked that cannot be pickled"):
            call({"x": {"y": _Hooked(3)}})
    assert stager._copies is None and not stager._buffers.preparing()
    assert torch.equal(stager.stage({"w": weight})["w"], weight)
    stager.close()


@pytest.mark.usefixtures("stand_in_stream")
def test_the_snapshot_copies_run_on_the_stand_in_stream_after_stage():
    """The snapshot's copies go through the stager's _copy_on, as the model's do: on the
    stand-in they run on its delayed side stream, after stage() has returned (before, they
    ran at once, so that no CPU test could catch a read of snapshot buffers not written yet),
    and the staged states are the export once the staging is complete."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = StandInFusedAdam(model.parameters())
    expected = get_optimizer_state_dict(model, optimizer)
    stager = StandIn(async_staging=True, delay_s=0.3)
    future = stager.stage({"optim": stager.optimizer_snapshot(model, optimizer)})
    assert stager._stream.enqueued == 2 * 3  # weight and bias, three states each
    _same_export(future.result()["optim"], expected)
    stager.close()


# prepare(): the buffers made before the first checkpoint; load_template(): the buffers as the
# template of a resume.


class _HeldTorch:
    """The buffers module's torch, whose empty() waits at its `at`-th call until `release` is
    set (`held` is set when it gets there); `made` holds weak references to what it made."""

    def __init__(self, at):
        self.at, self.made = at, []
        self.held, self.release = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(torch, name)

    def empty(self, *args, **kwargs):
        if len(self.made) + 1 == self.at:
            self.held.set()
            self.release.wait(10)
        tensor = torch.empty(*args, **kwargs)
        self.made.append(weakref.ref(tensor))
        return tensor


def _hold_allocation(monkeypatch, at=1):
    """Hold the stager's allocation of buffers at its `at`-th buffer (see _HeldTorch)."""
    held = _HeldTorch(at)
    monkeypatch.setattr(buffers_module, "torch", held)
    return held


@pytest.mark.usefixtures("stand_in_stream")
def test_prepare_makes_the_buffers_that_the_first_staging_takes():
    """prepare() allocates, in its thread, the buffers that staging the same state dict takes
    (CPU tensors and an optimizer snapshot, whose states the stand-in takes as the GPU's): the
    first stage() makes none (the same addresses, no overlapping staging), and what prepare()
    returns is the bytes the stager holds; a second prepare() has nothing to make."""
    model = torch.nn.Linear(8, 4)
    optimizer = StandInFusedAdam(model.parameters())
    stager = StandIn(async_staging=True)
    state = {
        "model": {"w": torch.arange(64.0)},
        "step": torch.tensor(5.0),
        "optim": stager.optimizer_snapshot(model, optimizer),
        "epoch": 3,
    }
    made = stager.prepare(state).result()
    # 64 FP32 elements, one, and three FP32 states of the 8 * 4 + 4 parameters
    assert made == stager.cached_bytes() == 4 * (64 + 1 + 3 * 36)
    pointers = stager._buffers.pointers()
    assert len(pointers) == 2 + 3 * 2
    assert stager.prepare(state).result() == 0
    staged = stager.stage(state).result()
    assert stager._buffers.pointers() == pointers and stager.overlapping_stagings == 0
    assert torch.equal(staged["model"]["w"], state["model"]["w"]) and staged["epoch"] == 3
    _same_export(staged["optim"], get_optimizer_state_dict(model, optimizer))
    stager.close()


@pytest.mark.parametrize("call", ["stage", "load_template"])
def test_stage_and_load_template_wait_for_a_prepare_under_way(monkeypatch, call):
    """The allocation held back: stage() (or load_template()) in another thread waits for the
    prepare(), then takes its buffers and makes none of its own."""
    held = _hold_allocation(monkeypatch)
    stager = StandIn(async_staging=True)
    state = {"model": {"w": _model(64)}, "b": torch.ones(3)}
    future = stager.prepare(state)
    assert held.held.wait(10)
    out = []
    waiting = threading.Thread(target=lambda: out.append(getattr(stager, call)(state)), daemon=True)
    waiting.start()
    waiting.join(0.3)
    assert waiting.is_alive() and not out and not future.done()
    held.release.set()
    waiting.join(10)
    assert future.result() == stager.cached_bytes() == 4 * (64 + 3)
    assert len(held.made) == 2 and stager.overlapping_stagings == 0
    got = out[0].result() if call == "stage" else out[0]
    assert sorted(t.data_ptr() for t in (got["model"]["w"], got["b"])) == stager._buffers.pointers()
    if call == "stage":
        assert torch.equal(got["model"]["w"], state["model"]["w"])
    stager.close()


def test_close_during_a_prepare_stops_it_and_frees_what_it_made(monkeypatch):
    """close() while prepare() allocates the second of eight buffers: it waits for that one,
    the prepare stops there (its future gives 0), and nothing it made is kept."""
    held = _hold_allocation(monkeypatch, at=2)
    stager = StandIn()
    future = stager.prepare({f"w{i}": _model(64) for i in range(8)})
    assert held.held.wait(10)
    closing = threading.Thread(target=stager.close, daemon=True)
    closing.start()
    deadline = time.monotonic() + 10
    while not stager._closed and time.monotonic() < deadline:
        time.sleep(0.01)
    held.release.set()
    closing.join(10)
    assert not closing.is_alive()
    assert future.result() == 0 and len(held.made) == 2
    gc.collect()
    assert stager.cached_bytes() == 0 and all(ref() is None for ref in held.made)


def test_prepare_refuses_while_one_is_under_way_and_after_close(monkeypatch):
    held = _hold_allocation(monkeypatch)
    stager = StandIn()
    state = {"w": _model(64)}
    future = stager.prepare(state)
    with pytest.raises(RuntimeError, match="prepare\\(\\) called while one is under way"):
        stager.prepare(state)
    held.release.set()
    assert future.result() == 4 * 64
    stager.close()
    with pytest.raises(RuntimeError, match="prepare\\(\\) called after close"):
        stager.prepare(state)


@pytest.mark.parametrize(
    "odd, error, match",
    [
        (torch.ones(2).as_subclass(Other), TypeError, "odd is a Other"),
        (_Config(torch.ones(2)), TypeError, "odd is a _Config that holds a tensor"),
        (torch.ones(2, device="meta"), RuntimeError, "odd is on meta"),
    ],
    ids=["subclass", "object", "meta"],
)
def test_a_value_that_stage_refuses_raises_at_prepare_and_starts_no_thread(odd, error, match):
    """What stage() would refuse raises at prepare(), before anything is allocated: no
    thread, no buffer, and the next prepare() runs."""
    stager = StandIn()
    with pytest.raises(error, match=match):
        stager.prepare({"w": _model(64), "odd": odd})
    assert stager._buffers._preparing is None and stager.cached_bytes() == 0
    assert "CheckpointStager.prepare" not in {t.name for t in threading.enumerate()}
    assert stager.prepare({"w": _model(64)}).result() == 4 * 64
    stager.close()


def test_load_template_gives_the_buffers_filled_and_the_next_staging_reuses_them():
    """The template holds the stager's buffers (those of the last staging) in place of the
    tensors, filled from the state dict, the other values copied. The next staging takes them
    once the template is dropped; while it (or a tensor of it) is alive, it keeps them, and
    the staging makes new ones (it overwrote the template before)."""
    weight = _model(64)
    stager = StandIn()
    state = {"model": {"w": weight, "b": torch.ones(3)}, "epoch": 3}
    stager.stage(state)  # dropped at once: its buffers are free
    weight.add_(1)
    template = stager.load_template(state)
    assert torch.equal(template["model"]["w"], weight) and template["epoch"] == 3
    loaded = template["model"]["w"].clone()
    weight.add_(1)
    pointers = stager._buffers.pointers()
    assert sorted(t.data_ptr() for t in template["model"].values()) == pointers
    staged = stager.stage(state)
    assert staged["model"]["w"].data_ptr() != template["model"]["w"].data_ptr()
    assert torch.equal(template["model"]["w"], loaded) and torch.equal(staged["model"]["w"], weight)
    assert stager.overlapping_stagings == 0
    template = stager.load_template(state)
    pointers = stager._buffers.pointers()
    del template, staged
    staged = stager.stage(state)
    assert stager._buffers.pointers() == pointers and stager.overlapping_stagings == 0
    assert torch.equal(staged["model"]["w"], weight)
    stager.close()


class _MeetingTorch:
    """The buffers module's torch, whose empty() waits until `meet` calls are under way at
    once (a barrier: it raises where they come one after the other), or raises `fail` at its
    `fail_at`-th call; `made` holds what it made, with the name of the thread that made it."""

    def __init__(self, meet, fail_at=None):
        self.barrier, self.fail_at, self.made = threading.Barrier(meet, timeout=5), fail_at, []
        self.calls = 0
        self.lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(torch, name)

    def empty(self, *args, **kwargs):
        with self.lock:
            self.calls += 1
            call = self.calls
        if call == self.fail_at:
            raise RuntimeError("pinned memory exhausted (injected)")
        if call <= self.barrier.parties:
            self.barrier.wait()
        tensor = torch.empty(*args, **kwargs)
        with self.lock:
            self.made.append((tensor, threading.current_thread().name))
        return tensor


class _Versioned(torch.nn.Module):
    """A module of state dict version 2, which notes the version that each load gives it
    (load_state_dict() passes None for a state dict without _metadata: an old one)."""

    _version = 2

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4))
        self.seen = []

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args):
        self.seen.append(local_metadata.get("version"))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)


@pytest.mark.parametrize("call", ["load_template", "stage"])
def test_a_staged_or_template_dict_keeps_its_type_and_metadata(tmp_path, call):
    """A module's state dict (an OrderedDict with _metadata, the modules' versions) keeps
    its type and _metadata in a template and in a staging: a model loaded from the template
    is given its version, as from DCP's own template (the caller's dict), where a plain dict
    would have load_state_dict() take the checkpoint as one of an old version."""
    source = _Versioned()
    with torch.no_grad():
        source.w.add_(1)
    dcp.save({"model": source.state_dict()}, checkpoint_id=tmp_path, no_dist=True)
    model = _Versioned()
    state = model.state_dict()
    stager = CheckpointStager()
    if call == "stage":
        staged = stager.stage({"model": state})
        assert type(staged["model"]) is collections.OrderedDict
        assert staged["model"]._metadata == state._metadata
        stager.close()
        return
    template = stager.load_template({"model": state})
    assert type(template["model"]) is collections.OrderedDict
    assert template["model"]._metadata == state._metadata
    dcp.load(template, storage_reader=ParallelFileSystemReader(tmp_path), no_dist=True)
    model.load_state_dict(template["model"])
    assert model.seen == [2] and torch.equal(model.w, source.w)
    stager.close()


def test_load_template_makes_the_buffers_it_lacks_at_once_by_several_threads(monkeypatch):
    """The buffers of a template that the stager lacks are made before its walk by its
    allocation threads, several at once (the first four allocations wait for each other),
    and the template holds those buffers: the walk makes none."""
    meeting = _MeetingTorch(meet=4)
    monkeypatch.setattr(buffers_module, "torch", meeting)
    stager = StandIn()
    state = {"model": {f"w{i}": _model(64) for i in range(6)}, "b": torch.ones(3), "epoch": 3}
    template = stager.load_template(state)
    assert len(meeting.made) == 7
    assert {n.startswith("CheckpointStager.allocate") for _, n in meeting.made} == {True}
    made = sorted(t.data_ptr() for t, _ in meeting.made)
    leaves = [*template["model"].values(), template["b"]]
    assert sorted(t.data_ptr() for t in leaves) == made == stager._buffers.pointers()
    assert all(torch.equal(template["model"][k], v) for k, v in state["model"].items())
    assert torch.equal(template["b"], state["b"]) and template["epoch"] == 3
    stager.close()


def test_a_failed_allocation_of_a_load_template_raises_and_keeps_no_buffer(monkeypatch):
    """One allocation of a template's buffers fails (pinned memory exhausted): load_template()
    raises that error, the stager keeps none of the buffers made beside it, and the next
    load_template() gives the whole template."""
    monkeypatch.setattr(buffers_module, "torch", _MeetingTorch(meet=1, fail_at=3))
    stager = StandIn()
    state = {"model": {f"w{i}": _model(64) for i in range(6)}}
    with pytest.raises(RuntimeError, match="pinned memory exhausted"):
        stager.load_template(state)
    assert stager.cached_bytes() == 0
    template = stager.load_template(state)
    assert all(torch.equal(template["model"][k], v) for k, v in state["model"].items())
    assert stager.cached_bytes() == 6 * 4 * 64
    stager.close()


@pytest.mark.parametrize("stager_was", ["fresh", "reused"])
@pytest.mark.parametrize("reader", [FileSystemReader, ParallelFileSystemReader])
def test_a_partial_load_into_a_load_template_keeps_the_state_dicts_value_of_a_missing_key(
    tmp_path, stager_was, reader
):
    """dcp.load with allow_partial_load into a load template whose state dict has keys that
    the checkpoint lacks (a CPU tensor, a GPU one): they keep the state dict's values, as a
    template of the state dict itself keeps them; a fresh stager's buffers held uninitialised
    memory, a reused one's the last staging's values."""
    saved = {"w": torch.randn(64)}
    dcp.save(saved, checkpoint_id=tmp_path, no_dist=True)
    stager = StandIn()
    if stager_was == "reused":
        stale = {"new": torch.full((32,), -3.0), "new_gpu": on_gpu(torch.full((8,), -3.0))}
        stager.stage({"w": torch.zeros(64), **stale})  # dropped at once
    state = {"w": torch.zeros(64), "new": torch.full((32,), 7.0)}
    state["new_gpu"] = on_gpu(torch.full((8,), 5.0))
    template = stager.load_template(state)
    planner = DefaultLoadPlanner(allow_partial_load=True)
    _read(tmp_path, template, reader(tmp_path), planner)
    assert torch.equal(template["w"], saved["w"])
    assert torch.equal(template["new"], state["new"])
    assert torch.equal(template["new_gpu"], state["new_gpu"])
    stager.close()


@pytest.mark.parametrize("reader", [FileSystemReader, ParallelFileSystemReader])
def test_a_tied_tensor_in_a_load_template_loads_as_in_the_state_dict_itself(tmp_path, reader):
    """One tensor under two keys of the state dict (tied weights), saved with two different
    values: its load template has one buffer under both keys, and loads what DCP loads into
    the state dict itself (the last key's value under both). Two different views of one
    memory (which DCP would load one over the other in part) are refused."""
    saved = {"embed": torch.randn(16), "head": torch.randn(16), "b": torch.randn(4)}
    dcp.save(saved, checkpoint_id=tmp_path, no_dist=True)
    tied = torch.zeros(16)
    dcp_own = _cpu_copies(_read(tmp_path, {"embed": tied, "head": tied, "b": torch.zeros(4)}))
    assert torch.equal(dcp_own["embed"], saved["head"])  # the last one read
    tied.zero_()
    stager = StandIn()
    template = stager.load_template({"embed": tied, "head": tied, "b": torch.zeros(4)})
    _same(_read(tmp_path, template, reader(tmp_path)), dcp_own)
    assert template["embed"].data_ptr() == template["head"].data_ptr()
    with pytest.raises(ValueError, match="head and embed share memory"):
        stager.load_template({"embed": tied, "head": tied[2:10]})
    stager.close()


class _Progress:
    """A Stateful (DCP's protocol: these two methods) without tensors."""

    def __init__(self, step):
        self.step = step

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state_dict):
        self.step = state_dict["step"]


class _AppState:
    """The DCP tutorial's AppState: a model and its optimizer, through get_state_dict and
    set_state_dict."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        model, optim = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state_dict):
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
        )


def _app_state():
    """An AppState whose model has a lambda forward hook (it stops a pickling of the model
    before its parameters) and whose optimizer has taken a step."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    model.register_forward_hook(lambda *_: None)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return _AppState(model, optimizer)


@pytest.mark.parametrize("reader", [FileSystemReader, ParallelFileSystemReader])
def test_a_stateful_in_a_load_template_is_the_callers_own_and_restored_in_place(tmp_path, reader):
    """dcp.load restores a Stateful at the top level of the state dict in place: it loads
    into its state_dict() and calls its load_state_dict(). A load template held a deep copy
    of it (or, the tutorial's AppState with a hooked model, refused it), so the caller's
    object was left as it was; it now holds the caller's object, restored as DCP restores it
    without a template."""
    torch.manual_seed(0)
    saved, weight = _app_state(), torch.randn(8)
    state = {"app": saved, "progress": _Progress(1234), "w": weight}
    dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    expected = _cpu_copies(saved.state_dict())
    torch.manual_seed(1)
    app, progress = _app_state(), _Progress(0)
    stager = CheckpointStager()
    template = stager.load_template({"app": app, "progress": progress, "w": torch.zeros(8)})
    assert template["app"] is app and template["progress"] is progress
    _read(tmp_path, template, reader(tmp_path))
    assert progress.step == 1234 and torch.equal(template["w"], weight)
    _same(_cpu_copies(app.state_dict()), expected)
    stager.close()


def test_prepare_and_stage_take_a_stateful_at_the_top_level_as_dcp_async_save_does(tmp_path):
    """dcp.async_save hands the stager a Stateful at the top level as its state_dict(), and
    prepare() takes what will be passed to dcp.async_save: it refused the tutorial's AppState
    ("holds a tensor"), or, its model hooked, deep-copied it and prepared no buffer. It now
    prepares the buffers of its state_dict(), which the checkpoint's staging takes."""
    torch.manual_seed(0)
    app = _app_state()
    stager = CheckpointStager()
    nbytes = sum(t.nbytes for t in stager_module._leaves(app.state_dict()))
    assert stager.prepare({"app": app, "progress": _Progress(7)}).result() == nbytes
    pointers = stager._buffers.pointers()
    state = {"app": app, "progress": _Progress(7)}
    dcp.async_save(state, checkpoint_id=tmp_path, async_stager=stager, no_dist=True).result()
    assert stager._buffers.pointers() == pointers and stager.overlapping_stagings == 0
    staged = stager.stage({"progress": _Progress(8)})  # as DCP would hand it over
    assert staged == {"progress": {"step": 8}}
    stager.close()


@pytest.mark.parametrize("reader", [FileSystemReader, ParallelFileSystemReader])
def test_views_of_one_array_in_a_load_template_are_tied_or_refused_by_their_memory(
    tmp_path, reader
):
    """Two torch.from_numpy views of one numpy array have storages of their own over the
    same memory. The load template told tied tensors and overlapping views by their storage,
    so it missed both: views of overlapping memory got a buffer each and loaded other values
    than DCP loads into them (which loads one over the other in part), and two views of the
    same memory (storages that start apart) loaded each its own key's value where DCP leaves
    the last key's in both. Now
    they are told by their memory: the same view is tied (one buffer, DCP's values), an
    overlapping one is refused with the ValueError."""
    np = pytest.importorskip("numpy")
    saved = {"a": torch.randn(8), "b": torch.randn(8)}
    dcp.save(saved, checkpoint_id=tmp_path, no_dist=True)
    array = np.zeros(12, dtype=np.float32)
    same = {"a": torch.from_numpy(array[2:10]), "b": torch.from_numpy(array)[2:10]}
    assert same["a"].data_ptr() == same["b"].data_ptr()
    assert same["a"].untyped_storage().data_ptr() != same["b"].untyped_storage().data_ptr()
    dcp_own = _cpu_copies(_read(tmp_path, dict(same)))
    assert torch.equal(dcp_own["a"], saved["b"])  # the last one read, in both
    array[:] = 0
    stager = CheckpointStager()
    template = stager.load_template(same)
    assert template["a"].data_ptr() == template["b"].data_ptr()
    _same(_read(tmp_path, template, reader(tmp_path)), dcp_own)
    overlapping = {"a": torch.from_numpy(array[:8]), "b": torch.from_numpy(array[4:12])}
    with pytest.raises(ValueError, match="b and a share memory"):
        stager.load_template(overlapping)
    stager.close()


@pytest.mark.parametrize("first", ["stage", "load_template"])
def test_a_staging_under_inference_mode_leaves_buffers_that_later_stagings_reuse(first):
    """A checkpoint (or a load template) taken under torch.inference_mode() made the kept
    buffers inference tensors, and every later staging outside inference mode raised (an
    in-place update of an inference tensor). The buffers are made outside inference mode."""
    weight = torch.randn(4)
    stager = CheckpointStager()
    with torch.inference_mode():
        getattr(stager, first)({"w": weight})
    pointers = stager._buffers.pointers()
    staged = stager.stage({"w": weight})
    assert torch.equal(staged["w"], weight) and not staged["w"].is_inference()
    assert stager._buffers.pointers() == pointers
    with torch.inference_mode():
        assert torch.equal(stager.stage({"w": weight + 1})["w"], weight + 1)
    stager.close()


@pytest.mark.parametrize("view", [torch.conj, torch._neg_view], ids=["conj", "neg"])
def test_a_conjugate_or_negative_view_in_a_load_template_is_refused(view):
    """A conjugate (or negative) view of a tensor under another key has the tensor's address,
    dtype, shape and stride: the load template took it as the same tensor and gave both keys
    one buffer, loading other values than DCP loads into the state dict itself (which reads
    both keys, one through the view). It is a different view of the same memory: refused."""
    tensor = torch.zeros(2, dtype=torch.complex64)
    stager = CheckpointStager()
    with pytest.raises(ValueError, match="b and a share memory"):
        stager.load_template({"a": tensor, "b": view(tensor)})
    assert len(stager.load_template({"a": view(tensor)})["a"]) == 2  # alone: its value
    stager.close()


@pytest.mark.parametrize("then", ["stage", "load_template"])
def test_a_live_tensor_in_another_keys_buffer_is_not_overwritten(then):
    """A load with assign=True that keeps the template's tensors under other keys (layers
    remapped) leaves live tensors in the buffers of other keys. The next staging checked only
    the buffer of a tensor's own key: it copied each tensor into another live tensor, changing
    the model and saving other values. Now no buffer that a staged tensor lies in is reused."""
    stager = CheckpointStager()
    template = stager.load_template(
        {"l0": torch.zeros(4), "l1": torch.zeros(4), "b": torch.ones(2)}
    )
    template["l0"].fill_(1.0)
    template["l1"].fill_(2.0)
    live = {"l0": template["l1"], "l1": template["l0"], "b": torch.ones(2)}  # reversed layers
    expected = _cpu_copies(live)
    staged = getattr(stager, then)(live)
    _same(_cpu_copies(live), expected)  # the live tensors as they were
    _same(_cpu_copies(staged), expected)  # and what the staging holds
    assert not {t.data_ptr() for t in staged.values()} & {t.data_ptr() for t in live.values()}
    del staged  # as an upload done: its buffers are free
    again = stager.stage(live)  # those made for the live tensors are reused as any other
    assert stager.overlapping_stagings == 0
    _same(_cpu_copies(again), expected)
    stager.close()


@pytest.mark.parametrize("then", ["stage", "load_template"])
def test_a_model_loaded_with_assign_keeps_its_values_when_another_takes_its_key(tmp_path, then):
    """A model loaded from a load template with assign=True holds the template's buffers as
    its parameters and, as the template's very tensors, its buffers (BatchNorm's statistics).
    The next staging (or template) of another model under the same key reused those buffers,
    which the state dict staged does not hold: it wrote the other model's values into the
    first one, whose next checkpoint then saved them. Now a template's buffer that any tensor
    still holds is not reused."""
    torch.manual_seed(0)
    teacher, student = (
        torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)) for _ in "ts"
    )
    with torch.no_grad():
        for i, buffer in enumerate((*teacher.buffers(), *student.buffers())):
            buffer.fill_(i + 1)  # the running statistics: the template's own tensors with assign
    dcp.save({"model": teacher.state_dict()}, checkpoint_id=tmp_path / "teacher")
    expected = _cpu_copies(teacher.state_dict())
    stager = CheckpointStager()
    template = stager.load_template({"model": teacher.state_dict()})
    dcp.load(template, storage_reader=ParallelFileSystemReader(tmp_path / "teacher"))
    teacher.load_state_dict(template["model"], assign=True)
    lent = {t.data_ptr() for t in template["model"].values()}
    assert {t.data_ptr() for t in teacher.state_dict().values()} == lent
    del template
    staged = getattr(stager, then)({"model": student.state_dict()})
    _same(_cpu_copies(teacher.state_dict()), expected)  # the teacher as it was loaded
    _same(_cpu_copies(staged["model"]), _cpu_copies(student.state_dict()))
    assert not {t.data_ptr() for t in staged["model"].values()} & lent
    del staged
    dcp.async_save(
        {"teacher": teacher.state_dict()}, checkpoint_id=tmp_path / "next", async_stager=stager
    ).result()
    _same(_raw(tmp_path / "next")["teacher"], expected)
    stager.close()


def test_an_optimizer_restored_from_a_load_template_keeps_its_states_through_the_next_template(
    tmp_path,
):
    """set_optimizer_state_dict keeps a CPU optimizer's states as the template's very tensors
    (the same dtype and device: no copy). A second template of the same stager (another
    optimizer with the same keys) reused those buffers and wrote its values into the first
    optimizer's states. Now it takes new ones."""

    def trained(seed):
        torch.manual_seed(seed)
        model = torch.nn.Linear(4, 4)
        optimizer = torch.optim.Adam(model.parameters())
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        return model, optimizer

    checkpoints = []
    for seed in (1, 2):
        model, optimizer = trained(seed)
        checkpoints.append((tmp_path / str(seed), optimizer.state[model.weight]["exp_avg"].clone()))
        dcp.save(
            {"optim": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=checkpoints[-1][0]
        )
    stager = CheckpointStager()
    restored = []
    for (path, _), seed in zip(checkpoints, (3, 4)):
        model, optimizer = trained(seed)
        template = stager.load_template({"optim": get_optimizer_state_dict(model, optimizer)})
        dcp.load(template, storage_reader=ParallelFileSystemReader(path))
        set_optimizer_state_dict(model, optimizer, template["optim"])
        del template
        restored.append((model, optimizer))
    for (model, optimizer), (_, exp_avg) in zip(restored, checkpoints):
        assert torch.equal(optimizer.state[model.weight]["exp_avg"], exp_avg)
    stager.close()


def test_a_load_templates_buffers_are_reused_by_the_next_staging_once_the_load_copied_them(
    tmp_path,
):
    """The usual resume (the template loaded, set into the model and a CUDA-less optimizer by
    copies, then dropped): the next staging reuses the template's buffers, however they were
    read; while the template is kept, the staging makes new ones and the template keeps its
    values."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    dcp.save({"model": model.state_dict()}, checkpoint_id=tmp_path)
    for reader in (FileSystemReader, ParallelFileSystemReader):
        for keep in (False, True):
            stager = CheckpointStager()
            template = stager.load_template({"model": model.state_dict()})
            dcp.load(template, storage_reader=reader(tmp_path))
            model.load_state_dict(template["model"])
            lent = sorted(t.data_ptr() for t in template["model"].values())
            loaded = _cpu_copies(template["model"])
            if not keep:
                del template
            staged = stager.stage({"model": model.state_dict()})
            reused = sorted(t.data_ptr() for t in staged["model"].values()) == lent
            assert reused != keep, (reader, keep)
            if keep:
                _same(_cpu_copies(template["model"]), loaded)
            del staged
            stager.close()


def test_a_view_kept_of_a_staged_tensor_is_not_overwritten_by_the_next_staging():
    """A view kept of a staged tensor (not the staged tensor itself, which the stager tracks)
    lies in that path's kept buffer: staged again under another key, beside a new value of the
    first, it was overwritten by that value before its own copy. Now a buffer that a tensor
    copied or passed through lies in is not reused (:meth:`BufferCache.lying_in`)."""
    stager = CheckpointStager()
    staged = stager.stage({"a": torch.arange(8.0)})
    kept = staged["a"][:4]  # a view of the buffer of "a"
    del staged
    again = stager.stage({"a": torch.full((8,), -1.0), "b": kept})
    assert torch.equal(kept, torch.arange(4.0)) and torch.equal(again["b"], torch.arange(4.0))
    assert torch.equal(again["a"], torch.full((8,), -1.0))
    stager.close()


@pytest.mark.parametrize("part", [lambda w: w, lambda w: w[1]], ids=["same", "part"])
def test_a_tensor_sharing_memory_with_a_stateful_in_a_load_template_is_refused(part):
    """A top-level Stateful stays the caller's object in a load template, which DCP loads into
    in place; another key holding one of its tensors (an EMA's view of a weight) got a buffer
    of its own, so the template loaded other values than DCP loads into the state dict
    itself. It is refused, with the ValueError of tensors that share memory."""
    model = torch.nn.Linear(2, 2)
    stager = CheckpointStager()
    with pytest.raises(ValueError, match="ema/w shares memory with model/weight"):
        stager.load_template({"model": model, "ema": {"w": part(model.weight.detach())}})
    template = stager.load_template({"model": model, "ema": {"w": model.weight.clone()}})
    assert template["model"] is model
    stager.close()


@pytest.mark.parametrize("part", [lambda t: t, lambda t: t[2:]], ids=["same", "part"])
def test_a_tensor_sharing_memory_with_a_private_one_in_a_load_template_is_refused(part):
    """A private tensor passes through a load template, which DCP loads into in place; another
    key holding its memory got a buffer of its own, so the two loaded apart where DCP loads
    both into that memory. It is refused, with the ValueError of tensors that share memory."""
    stager = CheckpointStager()
    y = torch.zeros(4)
    with pytest.raises(ValueError, match="b shares memory with a, a private tensor"):
        stager.load_template({"a": stager.private(y), "b": part(y)})
    template = stager.load_template({"a": stager.private(y), "b": y.clone()})
    assert template["a"] is y
    stager.close()


def test_load_template_refuses_while_a_staging_is_not_complete_and_after_close():
    hold = threading.Event()
    stager = StandIn(async_staging=True, hold=hold)
    state = {"w": _model(64)}
    future = stager.stage(state)
    with pytest.raises(RuntimeError, match="while a staging is not complete"):
        stager.load_template(state)
    hold.set()
    future.result()
    assert stager.load_template(state)["w"].shape == (64,)
    stager.close()
    with pytest.raises(RuntimeError, match="load_template\\(\\) called after close"):
        stager.load_template(state)


class FreshStandInFusedAdam(StandInFusedAdam):
    """StandInFusedAdam without states until its first step makes them (zero moments and the
    FP32 master copy, as FusedAdam's first step does); `lrs`: the learning rates its steps saw."""

    def __init__(self, params):  # pylint: disable=super-init-not-called
        torch.optim.Optimizer.__init__(self, params, {"lr": 0.1, "betas": (0.9, 0.99)})
        self.lrs = []

    def step(self, closure=None):
        for group in self.param_groups:
            self.lrs.append(group["lr"])
            group["step"] = group.get("step", 0) + 1
            for p in group["params"]:
                self.state[p] = self.state.get(p) or {
                    "exp_avg": torch.zeros(p.shape).bfloat16(),
                    "exp_avg_sq": torch.zeros(p.shape).bfloat16(),
                    "master_param": p.detach().float().clone(),
                }


@pytest.mark.usefixtures("stand_in_stream")
def test_a_snapshot_in_a_load_template_makes_the_optimizers_states_as_dcp_does():
    """An optimizer without states: prepare() refuses its snapshot (nothing to size the buffers
    by); load_template() makes its states as get_optimizer_state_dict() does (a step with zero
    gradients and learning rates) and gives the export's structure, its states in the stager's
    FP32 buffers, which the next snapshot reuses."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    twin = copy.deepcopy(model)
    optimizer, twins = FreshStandInFusedAdam(model.parameters()), FreshStandInFusedAdam(
        twin.parameters()
    )
    stager = StandIn()
    with pytest.raises(RuntimeError, match="no states yet"):
        stager.prepare({"optim": stager.optimizer_snapshot(model, optimizer)})
    template = stager.load_template({"optim": stager.optimizer_snapshot(model, optimizer)})
    export = get_optimizer_state_dict(twin, twins)  # makes the twin's states
    assert optimizer.lrs == twins.lrs == [0.0] and optimizer.param_groups[0]["lr"] == 0.1
    assert all(p.grad is None for p in model.parameters())
    _same(
        torch.optim.Optimizer.state_dict(optimizer)["state"],
        torch.optim.Optimizer.state_dict(twins)["state"],
    )
    optim = template["optim"]
    assert optim.keys() == export.keys() and optim["param_groups"] == export["param_groups"]
    states = _flat(optim["state"])
    assert states.keys() == _flat(export["state"]).keys()
    for key, value in states.items():
        assert value.dtype == torch.float32 and value.shape == _flat(export["state"])[key].shape
    pointers = stager._buffers.pointers()
    assert sorted(t.data_ptr() for t in states.values()) == pointers
    del template, optim, states, value  # dropped: the next staging may take the buffers
    staged = stager.stage({"optim": stager.optimizer_snapshot(model, optimizer)})
    assert stager._buffers.pointers() == pointers
    _same_export(staged["optim"], get_optimizer_state_dict(model, optimizer))
    stager.close()


def test_a_prepare_whose_thread_cannot_start_leaves_the_stager_usable(monkeypatch):
    """Thread.start() raises in prepare() (no thread to be had, or a KeyboardInterrupt): its
    future is never completed. stage(), load_template(), close() and the next prepare() must
    not wait for it (stage() undoes the same case for its own thread); they wait forever."""
    stager = StandIn()
    state = {"w": _model(64)}

    def cannot_start(thread):  # pylint: disable=unused-argument
        raise RuntimeError("can't start new thread")

    with monkeypatch.context() as patched:
        patched.setattr(threading.Thread, "start", cannot_start)
        with pytest.raises(RuntimeError, match="can't start new thread"):
            stager.prepare(state)
    staging = threading.Thread(target=stager.stage, args=(state,), daemon=True)
    staging.start()
    staging.join(timeout=5)
    assert not staging.is_alive(), "stage() waits forever for the prepare that never ran"
    stager.close()


_SIGNAL_CLOSE_IN_TEMPLATE = """
import signal, sys, torch
sys.path.insert(0, 'tests/staging')
from stand_in import StandIn, on_gpu
stager = StandIn()
signal.signal(signal.SIGTERM, lambda *_: stager.close())

class Preempted:
    def __deepcopy__(self, memo):  # the handler runs at the next bytecode: in load_template()
        signal.raise_signal(signal.SIGTERM)
        return 0

template = stager.load_template({'a': torch.ones(2), 'p': Preempted(), 'w': on_gpu(torch.ones(4))})
stager.close()
print(stager._closed, stager.cached_bytes())
"""


def test_close_from_a_signal_handler_during_load_template_leaves_no_buffer():
    """A preemption handler calls close() while load_template() walks the state dict in the
    thread it interrupted (as stage() is covered): the buffers that load_template() makes
    after the handler returned are freed at its end, none stays in the closed stager."""
    result = subprocess.run(
        [sys.executable, "-c", _SIGNAL_CLOSE_IN_TEMPLATE],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "True 0\n"


# ParallelFileSystemReader, against DCP's FileSystemReader on checkpoints that dcp.save wrote.


def _template(value):
    """A template of `value` that holds none of its data: its tensors' shapes and dtypes,
    filled with -1; None for the other values."""
    if isinstance(value, dict):
        return {k: _template(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        return torch.full(value.shape, -1, dtype=value.dtype)
    return None


def _read(path, template, reader=None, planner=None):
    """`template` loaded from the checkpoint at `path` by `reader` (DCP's FileSystemReader by
    default), in this process alone."""
    reader = reader or FileSystemReader(path)
    dcp.load(template, storage_reader=reader, planner=planner, no_dist=True)
    return template


def _byte_items(path):
    """How many values that are not tensors the checkpoint at `path` holds."""
    metadata = FileSystemReader(path).read_metadata().state_dict_metadata
    return sum(isinstance(md, BytesStorageMetadata) for md in metadata.values())


@pytest.mark.parametrize(
    "threads, chunk", [(8, reader_module.CHUNK_BYTES), (3, 1000)], ids=["default", "small_reads"]
)
def test_parallel_reader_reads_bitwise_what_the_file_system_reader_reads(
    tmp_path, monkeypatch, threads, chunk
):
    """Tensors of several dtypes and shapes (a 0-dim one, a view of a larger tensor), read
    directly, also in reads of 1000 bytes (not a multiple of an element) over 3 threads; the
    values that are not tensors through FileSystemReader.read_data; an empty tensor has no
    item. Both readers give the saved values bitwise."""
    monkeypatch.setattr(reader_module, "CHUNK_BYTES", chunk)
    torch.manual_seed(0)
    saved = {
        "f32": torch.randn(50, 70),
        "bf16": torch.randn(333).bfloat16(),
        "i16": torch.randint(-(2**15), 2**15, (40, 4), dtype=torch.int16),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 3),
        "view": torch.arange(400.0).view(100, 4)[30:60],
        "config": {"name": "run", "sizes": [1, 2]},
        "epoch": 7,
    }
    dcp.save(saved, checkpoint_id=tmp_path, no_dist=True)
    reader = ParallelFileSystemReader(tmp_path, thread_count=threads)
    _same(_read(tmp_path, _template(saved)), saved)
    _same(_read(tmp_path, _template(saved), reader), saved)
    assert (reader.fast_items, reader.other_items) == (5, 3) and _byte_items(tmp_path) == 3


def test_parallel_reader_reads_directly_where_torch_has_no_get_record_size(tmp_path, monkeypatch):
    """torch 2.11's PyTorchFileReader has no get_record_size(): the reader still reads the
    plain tensors directly, bitwise (the GPU machine's torch found this)."""
    real = torch._C.PyTorchFileReader  # pylint: disable=protected-access

    class Older:  # pylint: disable=too-few-public-methods
        def __init__(self, source):
            self._reader = real(source)

        def __getattr__(self, name):
            if name == "get_record_size":
                raise AttributeError(name)
            return getattr(self._reader, name)

    monkeypatch.setattr(torch._C, "PyTorchFileReader", Older)  # pylint: disable=protected-access
    saved = {"f32": torch.randn(50, 70), "i16": torch.arange(40, dtype=torch.int16)}
    dcp.save(saved, checkpoint_id=tmp_path, no_dist=True)
    reader = ParallelFileSystemReader(tmp_path)
    _same(_read(tmp_path, _template(saved), reader), saved)
    assert (reader.fast_items, reader.other_items) == (2, 0)


@pytest.mark.parametrize("case", ["template_strided", "template_bf16", "stored_transposed"])
def test_parallel_reader_leaves_what_it_cannot_read_directly_to_dcp(tmp_path, case):
    """A template that is not contiguous, a template of another dtype (DCP's copy converts)
    and a tensor stored not contiguous (a transposed one, saved as it is): read by
    FileSystemReader.read_data, with the standard reader's result."""
    torch.manual_seed(0)
    weight = torch.randn(6, 4)
    saved = {"w": weight.t() if case == "stored_transposed" else weight, "x": torch.randn(5)}
    dcp.save(saved, checkpoint_id=tmp_path, no_dist=True)

    def template():
        if case == "template_strided":
            return {"w": torch.full((4, 6), -1.0).t(), "x": torch.full((5,), -1.0)}
        dtype = torch.bfloat16 if case == "template_bf16" else torch.float32
        return {"w": torch.full(saved["w"].shape, -1, dtype=dtype), "x": torch.full((5,), -1.0)}

    reader = ParallelFileSystemReader(tmp_path)
    standard, parallel = _read(tmp_path, template()), _read(tmp_path, template(), reader)
    expected = {"w": saved["w"].to(standard["w"].dtype), "x": saved["x"]}
    _same(standard, expected)
    _same(parallel, expected)
    assert (reader.fast_items, reader.other_items) == (1, 1)


class _Part(DefaultLoadPlanner):
    """Loads the template's "w" as the part of the stored "w" at `offsets` (of the template's
    shape): the read item of a resharded load, its storage_offsets not 0, in one process.
    Its plan alone is its own: the item's destination is the template's "w" from its origin,
    which DefaultLoadPlanner's lookup_tensor finds."""

    def __init__(self, offsets):
        super().__init__()
        self.offsets = offsets
        self.items = None

    def create_local_plan(self):
        part = ChunkStorageMetadata(torch.Size(self.offsets), self.state_dict["w"].size())
        stored = self.metadata.state_dict_metadata["w"]
        origin = MetadataIndex("w", torch.Size([0] * len(self.offsets)))
        self.items = [
            dataclasses.replace(item, dest_index=origin)
            for item in create_read_items_for_chunk_list("w", stored, [part])
        ]
        return LoadPlan(self.items)


@pytest.mark.parametrize(
    "offsets, shape, direct",
    [((2, 0), (3, 8), True), ((4, 1), (1, 5), True), ((0, 3), (10, 2), False)],
    ids=["rows", "part_of_a_row", "columns"],
)
def test_parallel_reader_reads_a_part_of_a_stored_tensor(tmp_path, offsets, shape, direct):
    """A template narrower than the stored tensor: whole rows, or part of one row, are
    contiguous in the file and read directly from their offset; columns are not, and go
    through FileSystemReader.read_data. Both readers give the part bitwise."""
    stored = torch.randn(10, 8)
    dcp.save({"w": stored}, checkpoint_id=tmp_path, no_dist=True)
    expected = stored[offsets[0] : offsets[0] + shape[0], offsets[1] : offsets[1] + shape[1]]
    reader, planner = ParallelFileSystemReader(tmp_path), _Part(offsets)
    for got in (
        _read(tmp_path, {"w": torch.full(shape, -1.0)}, planner=_Part(offsets)),
        _read(tmp_path, {"w": torch.full(shape, -1.0)}, reader, planner),
    ):
        assert torch.equal(got["w"], expected)
    assert [item.storage_offsets for item in planner.items] == [torch.Size(offsets)]
    assert (reader.fast_items, reader.other_items) == ((1, 0) if direct else (0, 1))


@pytest.mark.parametrize("cut", ["last_byte", "half"])
def test_a_truncated_checkpoint_file_fails_the_load_with_either_reader(tmp_path, cut):
    """The data file cut short after the save: both readers raise (DCP's CheckpointException),
    neither leaves a template silently part-read."""
    saved = {"w": torch.randn(64, 64), "x": torch.randn(100), "epoch": 3}
    dcp.save(saved, checkpoint_id=tmp_path, no_dist=True)
    (data,) = tmp_path.glob("*.distcp")
    size = data.stat().st_size
    os.truncate(data, size - 1 if cut == "last_byte" else size // 2)
    for reader in (FileSystemReader(tmp_path), ParallelFileSystemReader(tmp_path)):
        with pytest.raises(dcp.CheckpointException):
            _read(tmp_path, _template(saved), reader)


def test_a_checkpoint_file_cut_while_it_is_read_fails_the_load(tmp_path, monkeypatch):
    """The data file cut short once the reader has planned its direct reads (another process
    rewriting the checkpoint meanwhile): a read that meets the end of the file raises, it does
    not leave the rest of the template as it was."""
    dcp.save({"w": torch.randn(64, 64), "epoch": 3}, checkpoint_id=tmp_path, no_dist=True)
    (data,) = tmp_path.glob("*.distcp")
    size = data.stat().st_size
    read = reader_module._read

    def cut_first(*args):  # the reads' first: "w" (the last item in the file) is planned
        if data.stat().st_size == size:
            os.truncate(data, size // 2)
        return read(*args)

    monkeypatch.setattr(reader_module, "_read", cut_first)
    with pytest.raises(dcp.CheckpointException, match="EOFError"):
        _read(
            tmp_path,
            {"w": torch.full((64, 64), -1.0), "epoch": 0},
            ParallelFileSystemReader(tmp_path),
        )


def test_a_checkpoint_file_renamed_over_after_its_header_is_checked_is_not_read_by_path(
    tmp_path, monkeypatch
):
    """Another checkpoint written to the same path (its data file renamed over this one) once
    the reader has checked the header and planned its reads, before it reads: the reads go to
    the file whose header was checked (one open per file per load), never to the new file at
    the old offsets, and the load refuses, saying that the file was replaced."""
    old = {"w": torch.arange(4096.0).view(64, 64)}
    dcp.save(old, checkpoint_id=tmp_path / "old", no_dist=True)
    dcp.save({"w": -old["w"]}, checkpoint_id=tmp_path / "new", no_dist=True)
    (data,) = (tmp_path / "old").glob("*.distcp")
    (new,) = (tmp_path / "new").glob("*.distcp")  # the same layout: the same offsets
    read = reader_module._read

    def renamed_over_first(*args):  # the reads' first: every header is checked
        if new.exists():
            os.replace(new, data)
        return read(*args)

    monkeypatch.setattr(reader_module, "_read", renamed_over_first)
    template = {"w": torch.full((64, 64), -1.0)}
    with pytest.raises(dcp.CheckpointException, match="was replaced or changed while it was read"):
        _read(tmp_path / "old", template, ParallelFileSystemReader(tmp_path / "old"))
    assert not new.exists() and torch.equal(template["w"], old["w"])


def _loader(reader, template):
    """A function that loads the checkpoint of `reader` into `template` (reset to -1 first)
    and returns a copy of it, or the exception: dcp.load's steps in one process, planned once
    (a damaged data file leaves the metadata and the plan as they are)."""
    planner = DefaultLoadPlanner()
    metadata = reader.read_metadata()
    planner.set_up_planner(template, metadata, True)
    reader.set_up_storage_reader(metadata, True)
    plan = planner.finish_plan(planner.create_global_plan([planner.create_local_plan()])[0])

    def load():
        for tensor in template.values():
            tensor.fill_(-1)
        try:
            reader.read_data(plan, planner).wait()
        except Exception as exc:  # pylint: disable=broad-exception-caught
            return exc
        return {key: tensor.clone() for key, tensor in template.items()}

    return load


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # torch.load's, of a damaged one
def test_no_flipped_bit_of_a_header_loads_other_values_than_dcps_reader(tmp_path):
    """Each bit of the data file but the tensor's own bytes, flipped in turn (a checkpoint of
    one small tensor: torch.save's zip records with their local headers, the pickle, the byte
    order and version records, the central directory and the end records): the parallel reader
    raises, or loads bitwise what DCP's FileSystemReader loads; never values where torch.load
    raises, nor other ones."""
    dcp.save({"w": torch.arange(12.0).view(3, 4)}, checkpoint_id=tmp_path, no_dist=True)
    (data,) = tmp_path.glob("*.distcp")
    original = data.read_bytes()
    with zipfile.ZipFile(io.BytesIO(original)) as archive:  # the one item, at offset 0
        (record,) = [info for info in archive.infolist() if info.filename.endswith("/data/0")]
    at = record.header_offset  # the local header: its name's and extra field's lengths
    start = at + 30 + sum(struct.unpack("<HH", original[at + 26 : at + 30]))
    payload = range(start, start + record.file_size)
    assert original[payload.start : payload.stop] == torch.arange(12.0).numpy().tobytes()
    reader = ParallelFileSystemReader(tmp_path, thread_count=2)
    ours = _loader(reader, {"w": torch.zeros(3, 4)})
    dcps = _loader(FileSystemReader(tmp_path), {"w": torch.zeros(3, 4)})
    assert torch.equal(ours()["w"], torch.arange(12.0).view(3, 4)) and reader.fast_items == 1
    silent = []
    for byte in range(len(original)):
        if byte in payload:
            continue
        for bit in range(8):
            damaged = bytearray(original)
            damaged[byte] ^= 1 << bit
            data.write_bytes(damaged)
            got = ours()
            if isinstance(got, Exception):
                continue
            expected = dcps()
            if isinstance(expected, Exception) or not torch.equal(got["w"], expected["w"]):
                silent.append(
                    (byte, bit, "raises" if isinstance(expected, Exception) else "differs")
                )
    assert not silent, f"{len(silent)} flips (byte, bit) load silently: {silent}"


class _Scratch(DefaultLoadPlanner):
    """Resolves every tensor to one scratch buffer and copies it into the template's tensor
    at commit_tensor: right under DCP's order (resolve, read, commit, item by item)."""

    def __init__(self):
        super().__init__()
        self.scratch = torch.empty(1 << 10)

    def resolve_tensor(self, read_item):
        target = super().resolve_tensor(read_item)
        return self.scratch[: target.numel()].view(target.shape)

    def commit_tensor(self, read_item, tensor):
        super().resolve_tensor(read_item).copy_(tensor)


@pytest.mark.parametrize("case", ["scratch_planner", "one_tensor_under_two_keys"])
def test_parallel_reader_keeps_dcps_order_where_targets_share_memory(tmp_path, case):
    """A planner whose resolve_tensor gives one scratch tensor that its commit_tensor copies
    out, and a template with one tensor under two keys (the first read by FileSystemReader:
    stored in BF16; the second directly): the parallel reader reads them as DCP's reader does,
    resolve, read and commit one item after the other (the last key's value in the shared
    tensor), not resolving every item first nor reading them at once."""
    torch.manual_seed(0)
    saved = {"a": torch.randn(8, 8), "b": torch.randn(16), "c": torch.randn(4, 4)}
    if case == "one_tensor_under_two_keys":
        saved = {"a": torch.randn(16).bfloat16(), "b": torch.randn(16)}
    dcp.save(saved, checkpoint_id=tmp_path, no_dist=True)

    def load(reader):
        if case == "scratch_planner":
            return _read(tmp_path, _template(saved), reader, _Scratch())
        shared = torch.full((16,), -1.0)
        return _read(tmp_path, {"a": shared, "b": shared}, reader)

    expected = load(FileSystemReader(tmp_path))
    if case == "scratch_planner":
        _same(expected, saved)
    else:
        assert expected["a"] is expected["b"] and torch.equal(expected["a"], saved["b"])
    reader = ParallelFileSystemReader(tmp_path)
    _same(load(reader), expected)
    assert (reader.fast_items, reader.other_items) == (0, len(saved))


class _Layout(DefaultLoadPlanner):
    """Its lookup_tensor gives "w" transposed where the checkpoint's "layout", a value that
    the plan reads before "w", says so (a planner that migrates an old layout)."""

    def lookup_tensor(self, index):
        tensor = super().lookup_tensor(index)
        if index.fqn == "w" and self.original_state_dict["layout"] == "transposed":
            return tensor.t()
        return tensor


class _FixUp(DefaultLoadPlanner):
    """Its load_bytes scales "w" by the checkpoint's "scale" as it loads that value (which
    the plan reads before "w": the read of "w" then overwrites it)."""

    def load_bytes(self, read_item, value):
        super().load_bytes(read_item, value)
        if read_item.dest_index.fqn == "scale":
            self.original_state_dict["w"].mul_(self.original_state_dict["scale"])


@pytest.mark.parametrize("planner", [_Layout, _FixUp])
def test_parallel_reader_leaves_a_planners_own_lookup_or_load_bytes_to_dcps_order(
    tmp_path, planner
):
    """A planner whose lookup_tensor or load_bytes depends on what the plan loaded before:
    DCP's reader loads the values "layout" and "scale" before "w", in the plan's order. The
    parallel reader resolved every tensor, then read every tensor, before any value of the
    file (with DefaultLoadPlanner's resolve_tensor and commit_tensor, whatever the planner's
    lookup_tensor and load_bytes): "w" loaded untransposed, or scaled. It now reads directly
    only with DefaultLoadPlanner's own hooks; this planner's items all go through
    FileSystemReader.read_data, which gives DCP's values."""
    saved = {"layout": "transposed", "scale": 2.0, "w": torch.arange(4.0).view(2, 2)}
    dcp.save(saved, checkpoint_id=tmp_path, no_dist=True)

    def load(reader):
        template = {"layout": "plain", "scale": 1.0, "w": torch.zeros(2, 2)}
        return _read(tmp_path, template, reader, planner())

    expected = load(FileSystemReader(tmp_path))
    assert torch.equal(expected["w"], saved["w"].t() if planner is _Layout else saved["w"])
    reader = ParallelFileSystemReader(tmp_path)
    _same(load(reader), expected)
    assert (reader.fast_items, reader.other_items) == (0, 3)


@pytest.mark.parametrize("count", [0, -1, "4", 2.0, True])
def test_parallel_reader_takes_a_positive_int_thread_count(tmp_path, count):
    with pytest.raises(ValueError, match="thread_count must be a positive int"):
        ParallelFileSystemReader(tmp_path, thread_count=count)


@pytest.mark.usefixtures("stand_in_stream")
def test_a_stagers_checkpoint_reads_the_same_through_either_reader_and_a_load_template(tmp_path):
    """A checkpoint that the stager wrote (the model's CPU tensors and the optimizer
    snapshot), read by FileSystemReader and by ParallelFileSystemReader into usual templates
    (a new model's, another optimizer's export), and by ParallelFileSystemReader into a new
    stager's load template of a new optimizer without states: each is the state at the save
    bitwise, every tensor read directly by the parallel reader."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    optimizer = StandInFusedAdam(model.parameters())
    stager = StandIn()
    state = {
        "model": model.state_dict(),
        "optim": stager.optimizer_snapshot(model, optimizer),
        "epoch": 3,
    }
    expected = {
        "model": _cpu_copies(model.state_dict()),
        "optim": get_optimizer_state_dict(model, optimizer),
        "epoch": 3,
    }
    dcp.async_save(state, checkpoint_id=tmp_path, async_stager=stager, no_dist=True).result()
    stager.close()
    torch.manual_seed(1)
    other = torch.nn.Linear(16, 8)

    def template():
        export = get_optimizer_state_dict(other, StandInFusedAdam(other.parameters()))
        return {"model": _cpu_copies(other.state_dict()), "optim": export, "epoch": 0}

    resumed = StandIn()
    into = resumed.load_template(
        {
            "model": other.state_dict(),
            "optim": resumed.optimizer_snapshot(other, FreshStandInFusedAdam(other.parameters())),
            "epoch": 0,
        }
    )
    parallel = [
        ParallelFileSystemReader(tmp_path, thread_count=2),
        ParallelFileSystemReader(tmp_path),
    ]
    _same(_read(tmp_path, template()), expected)
    _same(_read(tmp_path, template(), parallel[0]), expected)
    _same(_read(tmp_path, into, parallel[1]), expected)
    for reader in parallel:
        assert (reader.fast_items, reader.other_items) == (2 + 2 * 3, _byte_items(tmp_path))
    resumed.close()
