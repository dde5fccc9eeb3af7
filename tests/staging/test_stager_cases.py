"""GPU tests of the cases that a checkpoint could get wrong silently: each checkpoint, read
back raw (DCP's own conversion to a torch.save file, not a load into a template that could
hide a difference), is bitwise the state at the moment of dcp.async_save, also when training
goes on at once. One GPU is enough:

  torchrun --nproc_per_node=1 -m pytest -q tests/staging
"""

import collections
import os
import signal
import time

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

# pylint: disable=wrong-import-position
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, _async_process_executor
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.tensor import DTensor

import transformer_engine.pytorch as te

from te_fusedadam_offload.staging import CheckpointStager, ParallelFileSystemReader

from test_checkpoint_stager import SNAPSHOTS, _build, _step  # beside this file

OFFLOAD = StateDictOptions(cpu_offload=True)


def _leaves(value, path=()):
    """(path, leaf) of nested dicts, lists and tuples."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        yield path, value
        return
    for key, item in items:
        yield from _leaves(item, (*path, str(key)))


def _flat(value):
    """{path: leaf} of nested dicts, lists and tuples (keys as strings, DTensors as their
    local tensors, tensors as CPU copies): the state dict at one moment."""
    return {path: _cpu_copy(leaf) for path, leaf in _leaves(value)}


def _cpu_copy(leaf):
    if isinstance(leaf, DTensor):
        leaf = leaf._local_tensor
    if isinstance(leaf, torch.Tensor):
        leaf = leaf.detach().to("cpu", copy=True).contiguous()
    return leaf


def _raw(path):
    """The checkpoint at `path` as written (one rank here: local tensors are whole)."""
    dcp_to_torch_save(path, path + ".pt")
    return _flat(torch.load(path + ".pt", weights_only=False))


def _same(got, expected):
    assert got.keys() == expected.keys(), sorted(set(got) ^ set(expected))
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert isinstance(got[key], torch.Tensor), key
            assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
            assert torch.equal(
                got[key].view(-1).view(torch.uint8), value.view(-1).view(torch.uint8)
            ), key
        else:
            assert got[key] == value, key


def _hold(stager, cycles=5 * 10**8):
    """Hold the stager's side stream back (its copies start later), once it exists."""
    if stager._stream is not None:
        with torch.cuda.stream(stager._stream):
            torch.cuda._sleep(cycles)


def test_batchnorm_statistics_updated_at_once_under_async_staging(ckpt_root):
    """Train-mode forwards right after async_save update BatchNorm's running statistics in
    place on the current stream, while the side stream copies (held back, a large tensor
    first). Before, the saved running_mean was not the one at async_save (3 of 3 on an
    H200); the current stream now waits for the copies."""
    torch.manual_seed(0)
    big = torch.randn(2**26, device="cuda")
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.BatchNorm1d(256)).cuda()
    stager = CheckpointStager(async_staging=True)
    group = dist.new_group(backend="gloo")
    for n in range(3):
        model(torch.randn(64, 256, device="cuda"))
        state = {"big": big, "model": get_model_state_dict(model)}
        expected = _flat(state)
        _hold(stager)
        path = os.path.join(ckpt_root, f"bn{n}")
        result = dcp.async_save(state, checkpoint_id=path, process_group=group, async_stager=stager)
        del state
        for _ in range(5):  # at once, as the docs allow
            model(torch.randn(64, 256, device="cuda") * (n + 2))
        result.upload_completion.result()
        _same(_raw(path), expected)
    stager.close()


def test_adamw_cpu_step_and_tensor_lr_with_a_scheduler(ckpt_root):
    """torch's AdamW (FSDP2) keeps `step` on the CPU and increments it in place; a scheduler
    fill_()s its tensor lr; both change right after async_save (optimizer.step() without
    waiting for the staging), and so do the GPU states and parameters. Before, the CPU
    tensors were saved with their later values."""
    model, _ = _build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3), foreach=False)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    stager = CheckpointStager(async_staging=True)
    group = dist.new_group(backend="gloo")

    def train(step):
        _step(model, optimizer, step)
        scheduler.step()

    for n in range(3):
        train(10 * n)
        state = {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, optimizer),
        }
        expected = _flat(state)
        _hold(stager)
        path = os.path.join(ckpt_root, f"adamw{n}")
        result = dcp.async_save(state, checkpoint_id=path, process_group=group, async_stager=stager)
        del state
        for k in range(3):
            train(10 * n + k + 1)
        result.upload_completion.result()
        _same(_raw(path), expected)
    stager.close()


def _live(model, optimizer):
    """The model's state dict and FusedAdam's export, as a checkpoint holds them."""
    return {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer, options=OFFLOAD),
    }


def _at_async_save(model, optimizer, stager):
    """What a checkpoint taken now must hold (the model and FusedAdam's export, copied now by
    _flat), and the state dict that saves it through `stager`'s optimizer snapshot."""
    expected = _flat(_live(model, optimizer))
    state = {
        "model": get_model_state_dict(model),
        "optim": stager.optimizer_snapshot(model, optimizer),
    }
    return expected, state


def _snapshot_checkpoints(model, optimizer, ckpt_root, name, count=3):
    """`count` checkpoints with the optimizer snapshot, async staging, optimizer.step()
    right after each async_save (the side stream held back): each read back raw is the model
    and FusedAdam's export at async_save."""
    stager = CheckpointStager(async_staging=True)
    group = dist.new_group(backend="gloo")
    for n in range(count):
        _step(model, optimizer, 10 * n)
        expected, state = _at_async_save(model, optimizer, stager)
        _hold(stager)
        path = os.path.join(ckpt_root, f"{name}{n}")
        result = dcp.async_save(state, checkpoint_id=path, process_group=group, async_stager=stager)
        del state
        _step(model, optimizer, 10 * n + 1)  # not waiting for the staging
        result.upload_completion.result()
        _same(_raw(path), expected)
    stager.close()


def test_capturable_fused_adam_snapshot(ckpt_root):
    """capturable=True: FusedAdam's step and lr live on the GPU in the param groups (copied
    with the model's tensors, before the current stream goes on)."""
    model, optimizer = _build(capturable=True)
    _snapshot_checkpoints(model, optimizer, ckpt_root, "capturable")


def test_fp16_master_weights_snapshot(ckpt_root):
    """FP16 master weights: unscaled to FP32 on the side stream, as the export makes them."""
    model, optimizer = _build(master_weight_dtype=torch.float16)
    _snapshot_checkpoints(model, optimizer, ckpt_root, "fp16master")


def _fp8_model():
    init = getattr(te, "quantized_model_init", None) or te.fp8_model_init
    with init(enabled=True):
        model = torch.nn.Sequential(te.Linear(256, 256), te.Linear(256, 256)).cuda()
    optimizer = te.optimizers.FusedAdam(
        model.parameters(), lr=1e-3, master_weights=True, state_dict_cpu_offload=True
    )
    return model, optimizer


def _fp8_step(model, optimizer):
    autocast = getattr(te, "autocast", None) or te.fp8_autocast
    with autocast(enabled=True):
        out = model(torch.randn(32, 256, device="cuda"))
    out.float().square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_fp8_weights_are_refused_and_their_fused_adam_snapshot_is_whole(ckpt_root):
    """TE FP8 weights (quantized_model_init / fp8_model_init) are QuantizedTensors: before,
    copied into buffers of their nominal dtype (saved dequantized). Now async_save raises a
    TypeError that says what to do, before anything is copied or written, the stager stays
    usable, and the snapshot of their FusedAdam (FP32 master weights) saves bitwise."""
    model, optimizer = _fp8_model()
    _fp8_step(model, optimizer)
    stager = CheckpointStager(async_staging=True)
    group = dist.new_group(backend="gloo")
    refused = os.path.join(ckpt_root, "fp8-refused")
    with pytest.raises(TypeError, match="TE's quantized weights"):
        dcp.async_save(
            {
                "model": get_model_state_dict(model),
                "optim": stager.optimizer_snapshot(model, optimizer),
            },
            checkpoint_id=refused,
            process_group=group,
            async_stager=stager,
        )
    assert not os.path.exists(os.path.join(refused, ".metadata"))
    for n in range(2):
        expected = _flat({"optim": get_optimizer_state_dict(model, optimizer, options=OFFLOAD)})
        path = os.path.join(ckpt_root, f"fp8-optim{n}")
        result = dcp.async_save(
            {"optim": stager.optimizer_snapshot(model, optimizer)},
            checkpoint_id=path,
            process_group=group,
            async_stager=stager,
        )
        _fp8_step(model, optimizer)
        result.upload_completion.result()
        _same(_raw(path), expected)
    stager.close()


class _Odd(torch.Tensor):
    """A tensor subclass the stager does not know."""


def test_an_exception_mid_walk_leaves_nothing_and_the_next_checkpoint_is_whole(ckpt_root):
    """A refused value in the middle of the state dict, after the model's tensors and the
    snapshot: async_save raises, nothing is enqueued (the step does not wait for copies),
    nothing is written, and the next checkpoint is whole."""
    model, optimizer = _build()
    _step(model, optimizer, 0)
    stager = CheckpointStager(async_staging=True)
    group = dist.new_group(backend="gloo")
    bad = os.path.join(ckpt_root, "bad")
    state = {
        "model": get_model_state_dict(model),
        "optim": stager.optimizer_snapshot(model, optimizer),
        "odd": torch.ones(4, device="cuda").as_subclass(_Odd),
    }
    with pytest.raises(TypeError, match="is a _Odd"):
        dcp.async_save(state, checkpoint_id=bad, process_group=group, async_stager=stager)
    assert stager._copies is None and not os.path.exists(os.path.join(bad, ".metadata"))
    _snapshot_checkpoints(model, optimizer, ckpt_root, "after-bad", count=1)
    stager.close()


@pytest.mark.parametrize("where", ["training_thread", "staging_completion"])
def test_close_during_staging(ckpt_root, where):
    """close() while the staging's copies are held back on the side stream (from the
    training thread), or from a staging_completion callback (the stager's own thread): it
    waits for the staging, and the upload is whole."""
    model, optimizer = _build()
    stager = CheckpointStager(async_staging=True)
    group = dist.new_group(backend="gloo")
    _step(model, optimizer, 0)
    stager.stage({"model": get_model_state_dict(model)}).result()  # the side stream exists
    _step(model, optimizer, 1)
    expected, state = _at_async_save(model, optimizer, stager)
    _hold(stager)
    path = os.path.join(ckpt_root, f"close-{where}")
    result = dcp.async_save(state, checkpoint_id=path, process_group=group, async_stager=stager)
    del state
    assert not result.staging_completion.done()
    outcome = []

    def close(_):
        try:
            stager.close()
            outcome.append("closed")
        except BaseException as exc:  # pylint: disable=broad-exception-caught
            outcome.append(exc)

    if where == "staging_completion":
        result.staging_completion.add_done_callback(close)
    else:
        close(None)  # waits for the staging
        assert stager._pending is None
    _step(model, optimizer, 2)
    result.upload_completion.result()
    result.staging_completion.result()
    deadline = time.monotonic() + 10  # the callback runs in the stager's thread
    while not outcome and time.monotonic() < deadline:
        time.sleep(0.01)
    assert outcome == ["closed"] and stager.cached_bytes() == 0
    _same(_raw(path), expected)


def test_staged_parameters_record_no_autograd_history():
    """The model's parameters (FSDP2 DTensors, requires_grad) staged from the GPU, with
    autograd on: the staged copies and the kept buffers are leaves without grad, at every
    checkpoint (before, each buffer's grad_fn chain grew by one per checkpoint)."""
    model, _ = _build()
    params = dict(model.named_parameters())
    stager = CheckpointStager(async_staging=True)
    for _ in range(3):
        staged = stager.stage({"model": params}).result()
        for key, value in staged["model"].items():
            local = value._local_tensor if isinstance(value, DTensor) else value
            assert not value.requires_grad and local.grad_fn is None, key
        del staged, value, local
    for buffer, _ in stager._buffers._entries.values():
        assert buffer.is_leaf and not buffer.requires_grad
    assert all(p.grad is None for p in params.values())
    stager.close()


class _Preempted:
    """A value whose copy raises SIGTERM: its handler runs inside stage(), in the middle of
    the walk (after the model and the snapshot)."""

    def __deepcopy__(self, memo):
        signal.raise_signal(signal.SIGTERM)
        return 0


def test_close_from_a_signal_handler_during_staging(ckpt_root):
    """A preemption handler calls close() while async_save's stage() runs in the thread it
    interrupted: before, close() waited forever for the lock that stage() held. Now stage()
    finishes, waits for its copies, frees the buffers and removes the step hook; the
    checkpoint, written after the stager closed, is the state at async_save."""
    model, optimizer = _build()
    stager = CheckpointStager(async_staging=True)
    group = dist.new_group(backend="gloo")
    _step(model, optimizer, 0)
    stager.stage({"model": get_model_state_dict(model)}).result()  # the side stream exists
    _step(model, optimizer, 1)
    expected, state = _at_async_save(model, optimizer, stager)
    expected[("preempted",)], state["preempted"] = 0, _Preempted()  # SIGTERM when staged
    closed = []
    previous = signal.signal(signal.SIGTERM, lambda *_: closed.append(stager.close()))
    try:
        _hold(stager)
        path = os.path.join(ckpt_root, "close-signal")
        result = dcp.async_save(state, checkpoint_id=path, process_group=group, async_stager=stager)
    finally:
        signal.signal(signal.SIGTERM, previous)
    del state
    assert closed == [None] and stager._pending is None and stager._copies is None
    assert stager.cached_bytes() == 0 and len(stager._hooks) == 0
    _step(model, optimizer, 2)
    result.upload_completion.result()
    _same(_raw(path), expected)
    with pytest.raises(RuntimeError, match="after close"):
        stager.stage({"model": get_model_state_dict(model)})


def test_a_cuda_tensor_in_a_namedtuple_is_staged_to_the_host():
    """A CUDA tensor inside a namedtuple: before, deep-copied (cloned on the GPU, unordered
    with the side stream); now copied into a pinned host buffer like any other, and a tensor
    inside another object is refused."""
    pair = collections.namedtuple("Pair", "w s")
    weight = torch.randn(1024, device="cuda")
    stager = CheckpointStager(async_staging=True)
    staged = stager.stage({"p": pair(weight, 1)}).result()
    assert type(staged["p"]) is pair and staged["p"].s == 1
    assert staged["p"].w.device.type == "cpu" and staged["p"].w.is_pinned()
    assert torch.equal(staged["p"].w, weight.cpu())
    with pytest.raises(TypeError, match="holds a tensor"):
        stager.stage({"s": {weight}})
    stager.close()


def test_the_process_checkpointer_is_refused_at_async_save_and_the_thread_one_writes(ckpt_root):
    """dcp.async_save with AsyncCheckpointerType.PROCESS: pickling the staged state dict to
    DCP's checkpoint process would move the stager's pinned buffers into new shared memory
    (pinned no more after the first checkpoint). Refused at the call on every rank, before a
    copy, a checkpoint process or a file; the same stager then saves with the thread
    checkpointer, read back raw as staged. The CPU twin, on 1 and 2 gloo ranks, is in
    tests/tool/test_staging.py."""
    weight = torch.arange(2**20, dtype=torch.float32, device="cuda")
    state = {"model": {"w": weight}, "epoch": 3}
    expected = _flat(state)
    stager = CheckpointStager(async_staging=True)
    group = dist.new_group(backend="gloo")
    path = os.path.join(ckpt_root, "process")
    with pytest.raises(ValueError, match=r"checkpoint process .* AsyncCheckpointerType\.THREAD$"):
        dcp.async_save(
            state,
            checkpoint_id=path,
            process_group=group,
            async_stager=stager,
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
        )
    assert stager.cached_bytes() == 0 and stager._stream is None  # nothing copied
    assert _async_process_executor._CHECKPOINT_PROCESS is None
    assert not os.path.exists(path)
    path = os.path.join(ckpt_root, "thread")
    saving = dcp.async_save(
        state,
        checkpoint_id=path,
        process_group=group,
        async_stager=stager,
        async_checkpointer_type=AsyncCheckpointerType.THREAD,
    )
    weight.add_(1)  # after async_save: the checkpoint keeps the value staged
    saving.upload_completion.result()
    _same(_raw(path), expected)
    stager.close()


# prepare() before the first checkpoint; a resume into the stager's buffers
# (load_template() and ParallelFileSystemReader).


def _read(reader, model, optimizer):
    """The checkpoint of `reader` loaded into the usual templates (get_*_state_dict with
    cpu_offload: CPU copies, the model and optimizer left as they are), copied by _flat."""
    template = {
        "model": get_model_state_dict(model, options=OFFLOAD),
        "optim": get_optimizer_state_dict(model, optimizer, options=OFFLOAD),
    }
    dcp.load(template, storage_reader=reader)
    return _flat(template)


@pytest.mark.parametrize("config", SNAPSHOTS, ids=list(SNAPSHOTS))
def test_prepared_buffers_are_the_first_checkpoints_and_each_checkpoint_is_whole(ckpt_root, config):
    """prepare() of the state dict that async_save will get makes the buffers that the first
    checkpoint takes (the same addresses, no overlapping staging), and the second reuses them;
    each checkpoint, optimizer.step() right after its async_save, read back raw and through
    the usual templates with DCP's FileSystemReader, is the state at async_save."""
    model, optimizer = _build(**SNAPSHOTS[config])
    _step(model, optimizer, 0)
    stager = CheckpointStager(async_staging=True)
    made = stager.prepare(
        {"model": get_model_state_dict(model), "optim": stager.optimizer_snapshot(model, optimizer)}
    ).result()
    prepared = stager._buffers.pointers()
    assert made == stager.cached_bytes() > 0
    group = dist.new_group(backend="gloo")
    for n in range(2):
        expected, state = _at_async_save(model, optimizer, stager)
        _hold(stager)
        path = os.path.join(ckpt_root, f"prepared{n}")
        result = dcp.async_save(state, checkpoint_id=path, process_group=group, async_stager=stager)
        del state
        assert stager._buffers.pointers() == prepared and stager.overlapping_stagings == 0
        _step(model, optimizer, 10 * n + 1)  # not waiting for the staging
        result.upload_completion.result()
        _same(_raw(path), expected)
        _same(_read(FileSystemReader(path), model, optimizer), expected)
    stager.close()


Resumed = collections.namedtuple("Resumed", "model optimizer template reader peak")


def _resume(path, config, stager=None):
    """A new model and FusedAdam (no step taken) resumed from the checkpoint at `path`: into
    `stager`'s load template with ParallelFileSystemReader, or without a stager the standard
    way (templates of get_*_state_dict with cpu_offload, DCP's FileSystemReader). `peak`: the
    GPU memory that the resume added at its peak."""
    model, optimizer = _build(seed=99, **SNAPSHOTS[config])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    if stager is None:
        template = {
            "model": get_model_state_dict(model, options=OFFLOAD),
            "optim": get_optimizer_state_dict(model, optimizer, options=OFFLOAD),
        }
        reader = FileSystemReader(path)  # what dcp.load(..., checkpoint_id=path) takes
    else:
        template = stager.load_template(
            {
                "model": get_model_state_dict(model),
                "optim": stager.optimizer_snapshot(model, optimizer),
            }
        )
        reader = ParallelFileSystemReader(path)
    dcp.load(template, storage_reader=reader)
    set_model_state_dict(model, template["model"])
    set_optimizer_state_dict(model, optimizer, template["optim"])
    torch.cuda.synchronize()
    return Resumed(model, optimizer, template, reader, torch.cuda.max_memory_allocated() - before)


def _layouts(state):
    """{path: (placements, shape, stride, dtype, local device)} of the DTensors of `state`."""
    return {
        path: (v.placements, v.shape, v.stride(), v.dtype, v._local_tensor.device.type)
        for path, v in _leaves(state)
        if isinstance(v, DTensor)
    }


def _pointers(state):
    """The addresses of the tensors of `state` (of DTensors: their local tensors), sorted."""
    return sorted(
        (v._local_tensor if isinstance(v, DTensor) else v).data_ptr()
        for _, v in _leaves(state)
        if isinstance(v, torch.Tensor)
    )


def _same_resumed(a, b):
    """The models and FusedAdam's exports of two resumes are bitwise the same, with the same
    DTensor layouts."""
    a, b = _live(a.model, a.optimizer), _live(b.model, b.optimizer)
    _same(_flat(a), _flat(b))
    assert _layouts(a) == _layouts(b)


@pytest.mark.parametrize("writer", ["dcp_save", "stager"])
@pytest.mark.parametrize("config", SNAPSHOTS, ids=list(SNAPSHOTS))
def test_a_resume_into_the_stagers_buffers_is_the_standard_resume(ckpt_root, config, writer):
    """A checkpoint written by dcp.save of the usual state dicts, or by the stager with its
    optimizer snapshot (the step right after async_save), resumed into new optimizers without
    states: into a stager's load template with ParallelFileSystemReader, and the standard way.
    Both templates hold the state at the save bitwise, with the same DTensor layouts (the
    stager's: its own buffers, read directly); then the model and FusedAdam's export are
    bitwise the same in both, with the same layouts, and stay so after a step; the resume into
    the stager takes no more GPU memory. The next checkpoint, the template dropped, reuses its
    buffers and is whole (while a tensor holds one, it takes a new one: tests/tool)."""
    model, optimizer = _build(**SNAPSHOTS[config])
    _step(model, optimizer, 0)
    _step(model, optimizer, 1)
    path = os.path.join(ckpt_root, writer)
    group = dist.new_group(backend="gloo")
    if writer == "dcp_save":
        expected = _flat(_live(model, optimizer))
        dcp.save(_live(model, optimizer), checkpoint_id=path)
    else:
        writing = CheckpointStager(async_staging=True)
        expected, state = _at_async_save(model, optimizer, writing)
        result = dcp.async_save(
            state, checkpoint_id=path, process_group=group, async_stager=writing
        )
        del state
        _step(model, optimizer, 2)  # not waiting for the staging
        result.upload_completion.result()
        writing.close()
    stager = CheckpointStager(async_staging=True)
    new = _resume(path, config, stager)
    standard = _resume(path, config)
    _same(_flat(new.template), expected)
    _same(_flat(standard.template), expected)
    assert _layouts(new.template) == _layouts(standard.template)
    assert _pointers(new.template) == stager._buffers.pointers()
    assert new.reader.fast_items > 0
    assert new.peak <= standard.peak, (new.peak, standard.peak)
    _same_resumed(new, standard)
    for resumed in (new, standard):
        _step(resumed.model, resumed.optimizer, 3)
    _same_resumed(new, standard)
    new = new._replace(template=None)  # dropped, as a resume() function drops it
    pointers = stager._buffers.pointers()
    expected, state = _at_async_save(new.model, new.optimizer, stager)
    again = os.path.join(ckpt_root, f"{writer}-again")
    dcp.async_save(
        state, checkpoint_id=again, process_group=group, async_stager=stager
    ).upload_completion.result()
    del state
    assert stager._buffers.pointers() == pointers and stager.overlapping_stagings == 0
    _same(_raw(again), expected)
    stager.close()
