"""GPU tests of te_fusedadam_offload.staging.CheckpointStager with real TE, FSDP2 and DCP on disk,
and of torch_checkpointing's CheckpointManager with the export (skipped where it is not
installed).

  torchrun --nproc_per_node=2 -m pytest -q tests/staging   # any number of GPUs; plain pytest: 1

The series must be applied to the TE that is imported (FusedAdam(state_dict_cpu_offload=True)).
"""

import gc
import os
import threading
import weakref

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

# pylint: disable=wrong-import-position
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # PyTorch < 2.6
    from torch.distributed._composable.fsdp import fully_shard

import transformer_engine.pytorch as te

from te_fusedadam_offload.staging import CheckpointStager

from slow_storage import SlowWriter  # beside this file

OFFLOAD = StateDictOptions(cpu_offload=True)
WIDTH, LAYERS = 2048, 8


def _build(seed=0, moments=torch.bfloat16, **kwargs):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        *[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)]
    ).to(device="cuda", dtype=torch.bfloat16)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = te.optimizers.FusedAdam(
        model.parameters(),
        lr=1e-3,
        master_weights=True,
        exp_avg_dtype=moments,
        exp_avg_sq_dtype=moments,
        state_dict_cpu_offload=True,
        **kwargs,
    )
    return model, optimizer


def _inputs(step):
    g = torch.Generator(device="cuda").manual_seed(1000 + step + 7 * dist.get_rank())
    return torch.randn(16, WIDTH, device="cuda", dtype=torch.bfloat16, generator=g)


def _forward_backward(model, step):
    model(_inputs(step)).float().square().mean().backward()


def _step(model, optimizer, step):
    _forward_backward(model, step)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _snapshot(model, optimizer):
    """CPU copies of the local model and optimizer states, as DCP would save them."""
    out = {}
    state = {
        "model": get_model_state_dict(model, options=OFFLOAD),
        "optim": get_optimizer_state_dict(model, optimizer, options=OFFLOAD),
    }
    stack = [((), state)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            stack.extend(((*path, k), v) for k, v in value.items())
        elif isinstance(value, torch.Tensor):
            local = value._local_tensor if isinstance(value, DTensor) else value
            out[path] = local.detach().cpu().clone()
        else:
            out[path] = value
    return out


def _same(a, b):
    assert a.keys() == b.keys()
    for key, value in a.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == b[key].dtype and torch.equal(value, b[key]), key
        else:
            assert value == b[key], key


def _save(model, optimizer, stager, path, group, storage_writer=None):
    """dcp.async_save of the model (GPU) and the export (CPU) to `path`, or with
    `storage_writer` (which names its path)."""
    state = {
        "model": get_model_state_dict(model),  # GPU tensors: the stager copies them
        "optim": stager.optimizer_export(model, optimizer, options=OFFLOAD),
    }
    for value in state["optim"].value["state"].values():
        for tensor in value.values():
            if isinstance(tensor, torch.Tensor):
                assert tensor.device.type == "cpu"  # the export: passed through
    where = {"storage_writer": storage_writer} if storage_writer else {"checkpoint_id": path}
    return dcp.async_save(state, process_group=group, async_stager=stager, **where)


def _upload(result, async_staging):
    """The future of the upload of what _save() returned, once staging is complete."""
    if not async_staging:
        return result
    result.staging_completion.result()
    return result.upload_completion


def _load(path):
    model, optimizer = _build(seed=99)  # other values everywhere
    _step(model, optimizer, -1)  # states exist, to be overwritten in place
    state = {
        "model": get_model_state_dict(model, options=OFFLOAD),
        "optim": get_optimizer_state_dict(model, optimizer, options=OFFLOAD),
    }
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"], options=OFFLOAD)
    set_optimizer_state_dict(model, optimizer, state["optim"], options=OFFLOAD)
    return model, optimizer


@pytest.mark.parametrize("async_staging", [False, True], ids=["sync", "async"])
def test_consecutive_checkpoints_load_back_and_resume_bitwise(ckpt_root, async_staging):
    """Four checkpoints with one stager, training between them. Once staging is complete,
    the parameters are poisoned (NaN) until the upload is done: the model part is never read
    after staging. Each checkpoint loads back bitwise, and the next iteration from it gives
    bitwise the parameters and states of the original run's next iteration."""
    group = dist.new_group(backend="gloo")
    model, optimizer = _build()
    stager = CheckpointStager(async_staging=async_staging)
    saved, after = [], []
    for n in range(4):
        _step(model, optimizer, 10 * n)
        saved.append(_snapshot(model, optimizer))
        result = _save(model, optimizer, stager, os.path.join(ckpt_root, f"ckpt-{n}"), group)
        _forward_backward(model, 10 * n + 1)  # with async staging, beside the copies
        upload = _upload(result, async_staging)
        params = [p._local_tensor for p in model.parameters()]
        kept = [p.clone() for p in params]
        for p in params:
            p.fill_(float("nan"))
        upload.result()
        for p, k in zip(params, kept):
            p.copy_(k)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        after.append(_snapshot(model, optimizer))
    stager.close()
    for n in range(4):
        loaded_model, loaded_optimizer = _load(os.path.join(ckpt_root, f"ckpt-{n}"))
        _same(saved[n], _snapshot(loaded_model, loaded_optimizer))
        _step(loaded_model, loaded_optimizer, 10 * n + 1)
        _same(after[n], _snapshot(loaded_model, loaded_optimizer))


@pytest.mark.parametrize("async_staging", [False, True], ids=["sync", "async"])
def test_overlapping_checkpoints_with_a_slow_storage_writer_load_back_bitwise(
    ckpt_root, async_staging
):
    """Three checkpoints, each started before the previous upload is done (the storage writer
    waits 3 s before it writes), training between them. Before, the second staging overwrote
    the pinned buffers that the first upload had still to write. Now the overlapping stagings
    get new buffers: each checkpoint loads back bitwise as it was when staged, and once the
    uploads are done the next staging reuses the buffers."""
    model, optimizer = _build()
    stager = CheckpointStager(async_staging=async_staging)
    saved, uploads = [], []
    for n in range(3):
        _step(model, optimizer, 10 * n)
        saved.append(_snapshot(model, optimizer))
        writer = SlowWriter(os.path.join(ckpt_root, f"ckpt-{n}"), delay_s=3.0 if n < 2 else 0.0)
        # A group per checkpoint: DCP runs overlapping uploads at once, each in its thread.
        group = dist.new_group(backend="gloo")
        result = _save(model, optimizer, stager, None, group, storage_writer=writer)
        uploads.append(_upload(result, async_staging))
    assert not uploads[0].done()  # the later stagings came while it had still to write
    for upload in uploads:
        upload.result()
    assert stager.overlapping_stagings == 2
    pointers = stager._buffers.pointers()
    _step(model, optimizer, 100)
    result = _save(
        model, optimizer, stager, os.path.join(ckpt_root, "ckpt-3"), dist.new_group(backend="gloo")
    )
    _upload(result, async_staging).result()
    assert stager._buffers.pointers() == pointers
    assert stager.overlapping_stagings == 2
    stager.close()
    for n in range(3):
        loaded_model, loaded_optimizer = _load(os.path.join(ckpt_root, f"ckpt-{n}"))
        _same(saved[n], _snapshot(loaded_model, loaded_optimizer))


def _rss_bytes():
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def test_host_memory_stays_flat_and_buffers_are_reused(ckpt_root):
    """Eight checkpoints: the stager's pinned buffers are the same after the first, and the
    process's resident memory after each upload does not grow."""
    group = dist.new_group(backend="gloo")
    model, optimizer = _build()
    stager = CheckpointStager()
    rss, pointers = [], []
    for n in range(8):
        _step(model, optimizer, n)
        _save(model, optimizer, stager, os.path.join(ckpt_root, f"ckpt-{n % 2}"), group).result()
        gc.collect()
        rss.append(_rss_bytes())
        pointers.append(stager._buffers.pointers())
    model_bytes = sum(p._local_tensor.nbytes for p in model.parameters())
    # The model's buffers, not the export (private copies), at most a small CPU tensor more.
    assert model_bytes <= stager.cached_bytes() < model_bytes + 2**10
    assert all(p == pointers[0] for p in pointers)
    # After the first two (allocator warm-up), within 32 MiB: no per-checkpoint leak (a leaked
    # export would be 3 * 4 bytes per element, 384 MiB per checkpoint on one rank here).
    assert max(rss[2:]) - rss[2] < 32 * 2**20, [r / 2**20 for r in rss]
    stager.close()
    assert stager.cached_bytes() == 0


@pytest.mark.parametrize("async_staging", [False, True], ids=["sync", "async"])
def test_staged_model_is_pinned_cpu_with_the_same_spec_and_no_gpu_memory(async_staging):
    """The model's GPU DTensors come back as CPU DTensors around pinned buffers, with their
    mesh, placements, shape and stride; the export's CPU DTensors (optimizer_export) are the
    same objects; the staging allocates no GPU memory."""
    model, optimizer = _build()
    _step(model, optimizer, 0)
    stager = CheckpointStager(async_staging=async_staging)
    state = {
        "model": get_model_state_dict(model),
        "optim": stager.optimizer_export(model, optimizer, options=OFFLOAD),
    }
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    staged = stager.stage(state)
    staged = staged.result() if async_staging else staged
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() == before
    for name, value in state["model"].items():
        copy = staged["model"][name]
        assert isinstance(copy, DTensor) and copy._local_tensor.device.type == "cpu"
        assert copy._local_tensor.is_pinned()
        assert copy._spec == value._spec and copy.stride() == value.stride()
        assert torch.equal(copy._local_tensor, value._local_tensor.cpu())
    for fqn, states in state["optim"].value["state"].items():
        for name, value in states.items():
            assert staged["optim"]["state"][fqn][name] is value
    # A key the next state dict no longer has: its buffer is freed.
    first = next(iter(state["model"]))
    del state["model"][first]
    staged = stager.stage(state)
    staged = staged.result() if async_staging else staged
    model_bytes = sum(v._local_tensor.nbytes for v in state["model"].values())
    assert model_bytes <= stager.cached_bytes() < model_bytes + 2**10
    stager.close()


def test_stage_refuses_overlapping_staging_and_use_after_close():
    model, _ = _build()
    stager = CheckpointStager(async_staging=True)
    state = {"model": get_model_state_dict(model)}
    torch.cuda._sleep(10**9)  # keeps the side stream's copies waiting for a while
    future = stager.stage(state)
    with pytest.raises(RuntimeError, match="previous staging is not complete"):
        stager.stage(state)
    future.result()
    stager.close()
    with pytest.raises(RuntimeError, match="after close"):
        stager.stage(state)


def test_stager_does_not_keep_the_state_dict_after_staging():
    """Once staged (and uploaded), the state dict is the caller's and DCP's to drop: the
    stager keeps only its pinned buffers, not the export."""
    model, optimizer = _build()
    _step(model, optimizer, 0)
    for async_staging in (False, True):
        stager = CheckpointStager(async_staging=async_staging)
        export = stager.optimizer_export(model, optimizer, options=OFFLOAD)
        probe = weakref.ref(next(iter(next(iter(export.value["state"].values())).values())))
        staged = stager.stage({"model": get_model_state_dict(model), "optim": export})
        staged = staged.result() if async_staging else staged
        # The stager's thread completes the future before it lets go of what it staged.
        for thread in threading.enumerate():
            if thread.name == "CheckpointStager":
                thread.join()
        del staged, export
        gc.collect()
        assert probe() is None, async_staging
        stager.close()


# The optimizer snapshot: stager.optimizer_snapshot() in place of the export.

SNAPSHOTS = {
    "bf16": {"moments": torch.bfloat16},
    "fp16": {"moments": torch.float16},
    "fp8": {"moments": torch.uint8},
    "fp32": {"moments": torch.float32},
    "remainders": {"moments": torch.bfloat16, "store_param_remainders": True},
}


def _flat(state, prefix=()):
    """{path: value} of a nested state dict (tensors as they are)."""
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update(_flat(value, (*prefix, key)))
        else:
            out[(*prefix, key)] = value
    return out


@pytest.mark.parametrize("config", SNAPSHOTS, ids=list(SNAPSHOTS))
@pytest.mark.parametrize("async_staging", [False, True], ids=["sync", "async"])
def test_optimizer_snapshot_is_bitwise_the_export(config, async_staging):
    """The staged snapshot is FusedAdam's export (state_dict_cpu_offload=True) bitwise: the
    same keys, dtypes, values, DTensor specs and strides, in pinned CPU buffers that the next
    snapshot reuses; GPU memory: none for BF16/FP32/int16 states, one state in FP32 for FP16
    and FP8."""
    model, optimizer = _build(**SNAPSHOTS[config])
    _step(model, optimizer, 0)
    _step(model, optimizer, 1)  # FP16/FP8 scales other than their first
    expected = _flat(get_optimizer_state_dict(model, optimizer, options=OFFLOAD))
    stager = CheckpointStager(async_staging=async_staging)
    pointers = []
    for _ in range(2):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        staged = stager.stage({"optim": stager.optimizer_snapshot(model, optimizer)})
        staged = staged.result() if async_staging else staged
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        _same_export(expected, _flat(staged["optim"]))
        pointers.append(stager._buffers.pointers())
        del staged
        gc.collect()
    largest = max(p._local_tensor.numel() for p in model.parameters())
    if config in ("fp16", "fp8"):
        assert 0 < peak <= 4 * largest, peak
    else:
        assert peak == 0, peak
    assert pointers[0] == pointers[1]  # the buffers are reused
    stager.close()
    assert stager.cached_bytes() == 0


def _same_export(expected, got):
    """`got` is the export `expected` bitwise, in pinned CPU tensors."""
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        if not isinstance(value, torch.Tensor):
            assert got[key] == value, key
            continue
        copy = got[key]
        assert type(copy) is type(value) and copy.dtype == value.dtype, key
        assert copy.shape == value.shape and copy.stride() == value.stride(), key
        if isinstance(value, DTensor):
            assert copy._spec == value._spec, key
            copy, value = copy._local_tensor, value._local_tensor
        assert copy.device.type == "cpu" and copy.is_pinned(), key
        assert torch.equal(copy, value), key


def _save_snapshot(model, optimizer, stager, path, group):
    state = {
        "model": get_model_state_dict(model),
        "optim": stager.optimizer_snapshot(model, optimizer),
    }
    return dcp.async_save(state, checkpoint_id=path, process_group=group, async_stager=stager)


@pytest.mark.parametrize("async_staging", [False, True], ids=["sync", "async"])
def test_optimizer_snapshot_checkpoints_load_back_and_resume_bitwise(ckpt_root, async_staging):
    """Four checkpoints with optimizer snapshots, each iteration's optimizer.step() called
    right after async_save returned (forward and backward between), while the stager's side
    stream is held back (5e8 GPU cycles, a quarter of a second or so; from the second
    checkpoint on, once the stream exists): with async staging, only the step pre-hook keeps
    the step from overwriting the states before they are copied. Each checkpoint loads back
    bitwise (into a FusedAdam with state_dict_cpu_offload=True, through the usual template)
    and resumes bitwise; close() removes the hook."""
    group = dist.new_group(backend="gloo")
    model, optimizer = _build()
    stager = CheckpointStager(async_staging=async_staging)
    hooks = len(optimizer._optimizer_step_pre_hooks)
    saved, after, uploads = [], [], []
    for n in range(4):
        _step(model, optimizer, 10 * n)
        saved.append(_snapshot(model, optimizer))
        if stager._stream is not None:  # its copies start late
            with torch.cuda.stream(stager._stream):
                torch.cuda._sleep(5 * 10**8)
        result = _save_snapshot(model, optimizer, stager, os.path.join(ckpt_root, f"c{n}"), group)
        _step(model, optimizer, 10 * n + 1)  # not waiting for the staging
        after.append(_snapshot(model, optimizer))
        uploads.append(result.upload_completion if async_staging else result)
        uploads[-1].result()
    assert len(optimizer._optimizer_step_pre_hooks) == hooks + 1
    stager.close()
    assert len(optimizer._optimizer_step_pre_hooks) == hooks
    for n in range(4):
        loaded_model, loaded_optimizer = _load(os.path.join(ckpt_root, f"c{n}"))
        _same(saved[n], _snapshot(loaded_model, loaded_optimizer))
        _step(loaded_model, loaded_optimizer, 10 * n + 1)
        _same(after[n], _snapshot(loaded_model, loaded_optimizer))


def test_a_failed_snapshot_conversion_saves_nothing_and_the_next_checkpoint_is_whole(
    ckpt_root, monkeypatch
):
    """A fault while the BF16 states are widened: the upload raises, no checkpoint is there to
    be loaded, training goes on, and the next checkpoint loads back bitwise."""
    group = dist.new_group(backend="gloo")
    model, optimizer = _build()
    stager = CheckpointStager(async_staging=True)
    _step(model, optimizer, 0)

    def fault(buffer, dtype):
        raise RuntimeError("injected")

    from te_fusedadam_offload.staging import widening

    monkeypatch.setattr(widening, "widen", fault)
    result = _save_snapshot(model, optimizer, stager, os.path.join(ckpt_root, "bad"), group)
    # Not staging_completion: torch 2.11's async_save sets it to None when the staging future
    # has already failed as it returns (the fault comes at once here).
    with pytest.raises(RuntimeError, match="injected"):
        result.upload_completion.result()
    del result
    monkeypatch.undo()
    # Nothing loadable: no DCP metadata (which the good checkpoint below has).
    assert not os.path.exists(os.path.join(ckpt_root, "bad", ".metadata"))
    _step(model, optimizer, 1)
    saved = _snapshot(model, optimizer)
    result = _save_snapshot(model, optimizer, stager, os.path.join(ckpt_root, "good"), group)
    result.upload_completion.result()
    stager.close()
    assert os.path.exists(os.path.join(ckpt_root, "good", ".metadata"))
    loaded_model, loaded_optimizer = _load(os.path.join(ckpt_root, "good"))
    _same(saved, _snapshot(loaded_model, loaded_optimizer))


def test_an_optimizer_snapshot_is_staged_only_by_its_stager(ckpt_root):
    """Given to dcp.save without the stager (or to another stager), the snapshot raises
    instead of saving something that is not the optimizer's states."""
    model, optimizer = _build()
    stager = CheckpointStager()
    with pytest.raises(RuntimeError, match="no states yet"):
        stager.stage({"optim": stager.optimizer_snapshot(model, optimizer)})
    _step(model, optimizer, 0)
    # DCP reports the TypeError of pickling it inside its CheckpointException (a BaseException).
    with pytest.raises(dcp.CheckpointException, match="staged only by its CheckpointStager"):
        dcp.save({"optim": stager.optimizer_snapshot(model, optimizer)}, checkpoint_id=ckpt_root)
    other = CheckpointStager()
    with pytest.raises(TypeError, match="another CheckpointStager"):
        other.stage({"optim": stager.optimizer_snapshot(model, optimizer)})
    with pytest.raises(ValueError, match="full_state_dict"):
        stager.optimizer_snapshot(model, optimizer, options=StateDictOptions(full_state_dict=True))
    with pytest.raises(TypeError, match="TE FusedAdam"):
        stager.optimizer_snapshot(model, torch.optim.SGD(model.parameters(), lr=0.1))
    other.close()
    stager.close()


def test_torch_checkpointing_saves_the_export_without_copy_and_resumes_bitwise(ckpt_root):
    """torch_checkpointing's CheckpointManager (its asynchronous saver) with the export as an
    item that is not copied (ItemSpec(requires_copy=False)) and the model's GPU state staged by
    it: two checkpoints, optimizer.step() under manager.lock() right after each save; each
    loads back bitwise through the usual templates and resumes bitwise."""
    tc = pytest.importorskip("torch_checkpointing")
    model, optimizer = _build()
    from torch_checkpointing.storage.filesystem import (  # pylint: disable=import-outside-toplevel
        LocalFileSystemStorageConfig,
    )

    items = {"model": tc.ItemSpec(), "optim": tc.ItemSpec(requires_copy=False)}
    # Without O_DIRECT: on the H200 machine's /tmp it opened, then torch.save's unaligned
    # writes failed with EINVAL (torch_checkpointing 0.1.1).
    storage = LocalFileSystemStorageConfig(use_direct_io=False)
    manager = tc.CheckpointManager(tc.CheckpointManager.Config(items=items, storage_config=storage))
    saved, after = [], []
    try:
        for n in range(2):
            _step(model, optimizer, 10 * n)
            saved.append(_snapshot(model, optimizer))
            state = {
                "model": get_model_state_dict(model),
                "optim": get_optimizer_state_dict(model, optimizer, options=OFFLOAD),
            }
            write = manager.save(os.path.join(ckpt_root, f"tc{n}"), state)
            del state
            _forward_backward(model, 10 * n + 1)
            with manager.lock():
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            after.append(_snapshot(model, optimizer))
            write.result()
        for n in range(2):
            loaded_model, loaded_optimizer = _build(seed=99)
            _step(loaded_model, loaded_optimizer, -1)
            into = {
                "model": get_model_state_dict(loaded_model),
                "optim": get_optimizer_state_dict(loaded_model, loaded_optimizer, options=OFFLOAD),
            }
            loaded = manager.load(os.path.join(ckpt_root, f"tc{n}"), into=into)
            set_model_state_dict(loaded_model, loaded["model"])
            set_optimizer_state_dict(
                loaded_model, loaded_optimizer, loaded["optim"], options=OFFLOAD
            )
            _same(saved[n], _snapshot(loaded_model, loaded_optimizer))
            _step(loaded_model, loaded_optimizer, 10 * n + 1)
            _same(after[n], _snapshot(loaded_model, loaded_optimizer))
    finally:
        manager.close()
