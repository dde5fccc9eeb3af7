"""CPU checks of te_fusedadam_offload.staging.CheckpointStager (the GPU tests, with TE, FSDP2
and DCP on disk, are in tests/staging/). Where the stager's logic does not need a GPU, a
stand-in treats marked CPU tensors as the GPU's: it copies them into buffers as the stager
copies CUDA tensors into pinned ones."""

import contextlib
import copy
import gc
import pickle
import subprocess
import sys
import weakref

import pytest
from support import REPO

torch = pytest.importorskip("torch")

# DCP's note that a save or load without a process group is of one process: as meant here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# pylint: disable=wrong-import-position
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from te_fusedadam_offload import staging
from te_fusedadam_offload.staging import CheckpointStager

sys.path.insert(0, str(REPO / "tests" / "staging"))
from slow_storage import SlowWriter  # pylint: disable=wrong-import-order


def test_cpu_tensors_pass_through_and_other_values_are_copied():
    export = torch.arange(6, dtype=torch.float32)
    groups = [{"lr": 1e-4, "params": ["a", "b"]}]
    state = {"optim": {"state": {"a": {"exp_avg": export}}, "param_groups": groups}, "step": 3}
    stager = CheckpointStager()
    staged = stager.stage(state)
    assert staged["optim"]["state"]["a"]["exp_avg"] is export  # no copy of a copy
    assert staged["optim"]["param_groups"] == groups
    assert staged["optim"]["param_groups"] is not groups  # plain values: copied
    assert staged["optim"]["param_groups"][0]["params"] is not groups[0]["params"]
    assert staged["step"] == 3
    assert stager.cached_bytes() == 0
    stager.close()


def test_async_staging_without_gpu_tensors_gives_a_done_future():
    stager = CheckpointStager(async_staging=True)
    future = stager.stage({"x": torch.ones(2)})
    assert future.done() and torch.equal(future.result()["x"], torch.ones(2))
    stager.close()


def test_other_devices_are_refused():
    stager = CheckpointStager()
    with pytest.raises(RuntimeError, match="model/w is on meta"):
        stager.stage({"model": {"w": torch.empty(2, device="meta")}})


def test_without_torch_the_import_says_what_is_missing():
    code = "import sys; sys.modules['torch'] = None; import te_fusedadam_offload.staging"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: te_fusedadam_offload.staging needs PyTorch"), last
    assert "pip install '<its checkout>[staging]'" in last


class StandIn(CheckpointStager):
    """CheckpointStager where the tensors marked `on_gpu` stand for CUDA tensors: copied into
    plain CPU buffers at once, as the real one copies CUDA tensors into pinned buffers."""

    def _copied(self, tensor, path):
        return getattr(tensor, "on_gpu", False)

    def _allocate(self, shape, dtype):
        return torch.empty(shape, dtype=dtype)

    def _enqueue(self, copies, work):
        for _, dst, src in copies:
            dst.copy_(src)


def _model(n=1 << 16):
    weight = torch.arange(n, dtype=torch.float32)
    weight.on_gpu = True
    return weight


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


def _load(path, like):
    state = {"model": {"w": torch.empty_like(like)}}
    dcp.load(state, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return state["model"]["w"]


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
    ptrs = {t.data_ptr() for t, _ in stager._cache.values()}
    staged = stager.stage({"model": {"w": weight}})
    assert staged["model"]["w"].data_ptr() in ptrs and stager.overlapping_stagings == 2
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
    staging._widen(buffer, dtype)  # pylint: disable=protected-access
    assert torch.equal(buffer.view(torch.int32), values.float().view(torch.int32))


class FusedAdamLike(torch.optim.SGD):
    """What the snapshot asks of TE's FusedAdam before it stages anything."""

    def get_unscaled_state(self, param, state_name, skip_unscale=False):
        raise AssertionError("not called before stage()")


class FusedAdamWithItsOwnStateDict(FusedAdamLike):
    def state_dict(self):
        return dict(super().state_dict(), extra=1)


def test_an_optimizer_snapshot_refuses_to_be_copied_or_misconfigured():
    """The snapshot is for its stager's stage(): pickling or deep-copying it (as dcp.save and
    other stagers do with values they do not know) raises; so do full_state_dict, an
    optimizer other than TE's FusedAdam, and a subclass whose state_dict() the snapshot would
    not follow."""
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
    stager.close()


class _Copied:
    """Stands for the CUDA event of copies that are done."""

    def synchronize(self):
        pass


class _SideStream:
    """Stands for the side stream: its copies are done at once (they run on CPU here)."""

    def record_event(self):
        return _Copied()


class SnapshotStandIn(CheckpointStager):
    """CheckpointStager whose snapshot copies CPU states as it copies CUDA ones: into plain
    buffers, on a stand-in side stream (the real one: tests/staging on a GPU)."""

    def _allocate(self, shape, dtype):
        return torch.empty(shape, dtype=dtype)

    def _side_stream(self, device, path, work):
        work.device = device
        self._stream = _SideStream()
        return self._stream


@pytest.fixture
def stand_in_stream(monkeypatch):
    """What the stager does with its side stream on a GPU does nothing here: entering it, and
    recording the sources' use on it."""
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)


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
    stager = SnapshotStandIn()
    pointers = []
    for _ in range(2):
        staged = stager.stage(
            {"optim": stager.optimizer_snapshot(model, optimizer, options=options)}
        )
        _same_export(staged["optim"], expected)
        pointers.append(sorted(b.data_ptr() for b, _ in stager._cache.values()))
        del staged  # the buffers are free for the next snapshot
    assert pointers[0] == pointers[1]  # reused
    assert len(stager._hooks) == 1
    optimizer.step()  # the hook: nothing to wait for once the copies are done
    probe = weakref.ref(stager)
    del stager
    gc.collect()
    assert probe() is None  # the optimizer's hook does not keep the stager
    # It stays and does nothing: removed from the thread that drops the stager, it could
    # change the optimizer's hooks while a step goes through them.
    assert len(optimizer._optimizer_step_pre_hooks) == 1
    optimizer.step()
    stager = SnapshotStandIn()
    stager.stage({"optim": stager.optimizer_snapshot(model, optimizer)})
    stager.close()
    assert len(stager._hooks) == 0 and stager.cached_bytes() == 0
    probe = weakref.ref(optimizer)
    other = SnapshotStandIn()
    other.stage({"optim": other.optimizer_snapshot(model, optimizer)})
    del optimizer
    gc.collect()
    assert probe() is None  # the stager does not keep the optimizer
    other.close()


@pytest.mark.usefixtures("stand_in_stream")
def test_a_failed_widening_leaves_nothing_for_a_step_to_wait_for(monkeypatch):
    """The widening of a BF16 state raises: the staging raises it, the copies are waited for
    anyway, so that no later step waits (or refuses a capture), and the next staging runs."""
    model = torch.nn.Linear(8, 4)
    optimizer = StandInFusedAdam(model.parameters())
    stager = SnapshotStandIn()

    def fails(buffer, dtype):
        raise MemoryError("injected")

    with monkeypatch.context() as patched:
        patched.setattr(staging, "_widen", fails)
        with pytest.raises(MemoryError, match="injected"):
            stager.stage({"optim": stager.optimizer_snapshot(model, optimizer)})
    assert stager._snapshot_event is None and stager._idle.is_set()
    expected = get_optimizer_state_dict(model, optimizer)
    _same_export(
        stager.stage({"optim": stager.optimizer_snapshot(model, optimizer)})["optim"], expected
    )
    stager.close()
