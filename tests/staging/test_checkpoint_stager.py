"""GPU tests of te_fusedadam_offload.staging.CheckpointStager with real TE, FSDP2 and DCP on disk.

  torchrun --nproc_per_node=2 -m pytest -q tests/staging   # any number of GPUs; plain pytest: 1

Not yet run on a GPU with the stager as it is now: the overlap test (a slow storage writer,
checkpoints that start before the previous upload is done) was written without one, and the
others last ran on one H200 before the stager's buffers were made to wait for their uploads.

The series must be applied to the TE that is imported (FusedAdam(state_dict_cpu_offload=True)).
"""

import gc
import weakref
import os
import tempfile

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


@pytest.fixture(scope="module", autouse=True)
def process_group():
    """The torchrun group, or a one-process group of this pytest."""
    if "LOCAL_RANK" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK="0", WORLD_SIZE="1")
        os.environ["LOCAL_RANK"] = "0"
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend="cpu:gloo,cuda:nccl")
    yield
    dist.destroy_process_group()


@pytest.fixture
def ckpt_root():
    """A directory shared by the ranks, removed afterwards."""
    holder = [tempfile.mkdtemp(prefix="stager-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    yield holder[0]
    dist.barrier()
    if dist.get_rank() == 0:
        for root, dirs, files in os.walk(holder[0], topdown=False):
            for name in files:
                os.remove(os.path.join(root, name))
            for name in dirs:
                os.rmdir(os.path.join(root, name))
        os.rmdir(holder[0])


def _build(seed=0):
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
        exp_avg_dtype=torch.bfloat16,
        exp_avg_sq_dtype=torch.bfloat16,
        state_dict_cpu_offload=True,
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
        "optim": get_optimizer_state_dict(model, optimizer, options=OFFLOAD),
    }
    for value in state["optim"]["state"].values():
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
    pointers = {t.data_ptr() for t, _ in stager._cache.values()}
    _step(model, optimizer, 100)
    result = _save(
        model, optimizer, stager, os.path.join(ckpt_root, "ckpt-3"), dist.new_group(backend="gloo")
    )
    _upload(result, async_staging).result()
    assert {t.data_ptr() for t, _ in stager._cache.values()} == pointers
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
        pointers.append(sorted(t.data_ptr() for t, _ in stager._cache.values()))
    model_bytes = sum(p._local_tensor.nbytes for p in model.parameters())
    assert stager.cached_bytes() == model_bytes
    assert all(p == pointers[0] for p in pointers)
    # After the first two (allocator warm-up), within 32 MiB: no per-checkpoint leak (a leaked
    # export would be 3 * 4 bytes per element, 384 MiB per checkpoint on one rank here).
    assert max(rss[2:]) - rss[2] < 32 * 2**20, [r / 2**20 for r in rss]
    stager.close()
    assert stager.cached_bytes() == 0


@pytest.mark.parametrize("async_staging", [False, True], ids=["sync", "async"])
def test_staged_model_is_pinned_cpu_with_the_same_spec_and_no_gpu_memory(async_staging):
    """The model's GPU DTensors come back as CPU DTensors around pinned buffers, with their
    mesh, placements, shape and stride; the export's CPU DTensors are the same objects; the
    staging allocates no GPU memory."""
    model, optimizer = _build()
    _step(model, optimizer, 0)
    stager = CheckpointStager(async_staging=async_staging)
    state = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer, options=OFFLOAD),
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
    for fqn, states in state["optim"]["state"].items():
        for name, value in states.items():
            assert staged["optim"]["state"][fqn][name] is value
    # A key the next state dict no longer has: its buffer is freed.
    first = next(iter(state["model"]))
    del state["model"][first]
    staged = stager.stage(state)
    staged = staged.result() if async_staging else staged
    assert stager.cached_bytes() == sum(v._local_tensor.nbytes for v in state["model"].values())
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
        export = get_optimizer_state_dict(model, optimizer, options=OFFLOAD)
        probe = weakref.ref(next(iter(next(iter(export["state"].values())).values())))
        staged = stager.stage({"model": get_model_state_dict(model), "optim": export})
        staged = staged.result() if async_staging else staged
        del staged, export
        gc.collect()
        assert probe() is None, async_staging
        stager.close()
