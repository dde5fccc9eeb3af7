# Copyright (c) 2022-2026, NVIDIA CORPORATION & AFFILIATES. All rights reserved.
#
# See LICENSE for license information.

"""Tests for FusedAdam(state_dict_cpu_offload=True) on one GPU, against the default path.

The export and the load with the option are compared bitwise with the default path for
each moment dtype and master-weight variant, with plain and DTensor parameters; mismatched
state dicts, hooks and failures in the middle of an export or a load are checked too.
test_fused_optimizer.py holds the state_dict round trip against torch.optim.Adam and the
GPU memory bound; tests/pytorch/distributed/fsdp2_tests/run_fsdp2_fused_adam.py the FSDP2
and DCP cases.
"""

import copy
import gc
import importlib
import inspect
import os
import sys
import threading

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("FusedAdam state_dict CPU offload tests need a CUDA GPU.", allow_module_level=True)

# pylint: disable=wrong-import-position
import transformer_engine.pytorch as te
from transformer_engine.pytorch import is_bf16_available

if not te.torch_version() >= (2, 4, 0):
    pytest.skip("Requires PyTorch 2.4.0+ (DTensor states).", allow_module_level=True)
if not is_bf16_available():
    pytest.skip("bf16 is not supported (the parameters are BF16).", allow_module_level=True)

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from transformer_engine.pytorch.optimizers import fused_adam
from transformer_engine.pytorch.tensor.float8_tensor import Float8Tensor

FusedAdam = te.optimizers.FusedAdam

# FP8 moments need FP8 support.
fp8_available, reason_for_no_fp8 = te.is_fp8_available(return_reason=True)
requires_fp8 = pytest.mark.skipif(not fp8_available, reason=reason_for_no_fp8)


def _cases(*combinations):
    """(exp_avg, exp_avg_sq, master) parameters, those with FP8 moments marked requires_fp8."""
    return [pytest.param(*c, marks=[requires_fp8] if "fp8" in c[:2] else []) for c in combinations]


MOMENT_DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.uint8,
}

# name: (master_weights, master_weight_dtype, store_param_remainders)
MASTER_VARIANTS = {
    "no_master": (False, torch.float32, False),
    "master_fp32": (True, torch.float32, False),
    "master_fp16": (True, torch.float16, False),
    "master_fp32_remainders": (True, torch.float32, True),
}

PARAM_SHAPES = [(257, 33), (1000,), (6, 7, 3), (1,)]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    """A one-rank CUDA device mesh, for DTensor parameters."""
    if not dist.is_initialized():
        store = tmp_path_factory.mktemp("dist") / "store"
        dist.init_process_group(backend="nccl", init_method=f"file://{store}", rank=0, world_size=1)
    torch.cuda.set_device(0)
    yield init_device_mesh("cuda", (1,))
    dist.destroy_process_group()


def _make_params(shapes, dtype, mesh=None, seed=1234):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    params = []
    for i, shape in enumerate(shapes):
        data = torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)
        if mesh is not None:
            placement = Shard(0) if i % 2 == 0 else Replicate()
            data = distribute_tensor(data, mesh, [placement])
        params.append(torch.nn.Parameter(data))
    return params


def _set_grads(params, step, seed=4321):
    gen = torch.Generator(device="cuda").manual_seed(seed + step)
    for p in params:
        local = p._local_tensor if isinstance(p, DTensor) else p
        grad = torch.randn(local.shape, generator=gen, device="cuda").to(local.dtype)
        if isinstance(p, DTensor):
            grad = DTensor.from_local(
                grad, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
            )
        p.grad = grad


def _optimizer_kwargs(exp_avg, exp_avg_sq, master, capturable=False):
    master_weights, master_weight_dtype, store_param_remainders = MASTER_VARIANTS[master]
    return dict(
        lr=1e-2,
        weight_decay=0.01,
        master_weights=master_weights,
        master_weight_dtype=master_weight_dtype,
        store_param_remainders=store_param_remainders,
        exp_avg_dtype=MOMENT_DTYPES[exp_avg],
        exp_avg_sq_dtype=MOMENT_DTYPES[exp_avg_sq],
        capturable=capturable,
    )


def _build(kwargs, mesh=None, steps=3, shapes=PARAM_SHAPES, param_dtype=torch.bfloat16):
    """Params (the last one never gets a gradient) and an optimizer after `steps` steps."""
    params = _make_params(shapes, param_dtype, mesh)
    frozen = _make_params([(4, 4)], param_dtype, mesh, seed=99)[0]
    opt = FusedAdam([{"params": params}, {"params": [frozen]}, {"params": []}], **kwargs)
    for step in range(steps):
        _set_grads(params, step)
        opt.step()
    return params, opt


def _local(t):
    return t._local_tensor if isinstance(t, DTensor) else t


def _raw_state(opt):
    """Bitwise snapshot of the live optimizer state: stored bytes, scales and devices."""
    snapshot = {}
    for p, state in opt.state.items():
        for name, value in state.items():
            local = _local(value)
            if isinstance(local, Float8Tensor):
                data = (
                    local._data.clone(),
                    local._scale_inv.clone(),
                    local._quantizer.scale.clone(),
                )
                if local._transpose is not None:
                    data += (local._transpose.clone(),)
            else:
                data = (local.clone(),)
            snapshot[(id(p), name)] = (value, local.device, local.dtype, data)
    for p, scales in opt._scales.items():
        for name, scale in scales.items():
            snapshot[(id(p), name, "scale")] = (scale, scale.device, scale.dtype, (scale.clone(),))
    return snapshot


def _assert_raw_state_equal(actual, expected, same_objects=True):
    assert actual.keys() == expected.keys()
    for key, (obj, device, dtype, data) in expected.items():
        a_obj, a_device, a_dtype, a_data = actual[key]
        if same_objects:
            assert a_obj is obj, key
        assert (a_device, a_dtype) == (device, dtype), key
        for a, e in zip(a_data, data):
            assert torch.equal(a, e), key


def _assert_param_groups_equal(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.keys() == e.keys()
        for key in e:
            if isinstance(e[key], torch.Tensor):
                assert torch.equal(a[key], e[key]) and a[key].device == e[key].device, key
            else:
                assert a[key] == e[key], key


def _assert_offloaded_equal(offloaded, reference):
    """`offloaded` is on CPU and bitwise equal to `reference`, a default export."""
    _assert_param_groups_equal(offloaded["param_groups"], reference["param_groups"])
    assert offloaded["state"].keys() == reference["state"].keys()
    for k, ref_v in reference["state"].items():
        v = offloaded["state"][k]
        assert v.keys() == ref_v.keys(), k
        for name, ref in ref_v.items():
            out = v[name]
            assert type(out) is type(ref), (k, name)
            assert out.dtype == ref.dtype, (k, name)
            assert out.shape == ref.shape and out.stride() == ref.stride(), (k, name)
            if isinstance(ref, DTensor):
                assert out.device_mesh == ref.device_mesh, (k, name)
                assert out.placements == ref.placements, (k, name)
                assert out._local_tensor.device.type == "cpu", (k, name)
                assert out._local_tensor.stride() == ref._local_tensor.stride(), (k, name)
                assert torch.equal(out._local_tensor, ref._local_tensor.cpu()), (k, name)
            else:
                assert out.device.type == "cpu", (k, name)
                assert torch.equal(out, ref.cpu()), (k, name)


def _default_state_dict(opt):
    """The default export of `opt`, copied so that later steps cannot change it."""
    offload = opt.state_dict_cpu_offload
    opt.state_dict_cpu_offload = False
    try:
        return _clone_state_dict(opt.state_dict())
    finally:
        opt.state_dict_cpu_offload = offload


# Each moment dtype in each of the two moments, each master-weight variant twice.
COMBINATIONS = _cases(
    ("fp32", "fp32", "no_master"),
    ("bf16", "bf16", "master_fp32"),
    ("fp16", "fp16", "master_fp16"),
    ("fp8", "fp8", "master_fp32"),
    ("bf16", "fp16", "master_fp32_remainders"),
    ("fp8", "bf16", "master_fp16"),
    ("fp16", "fp8", "no_master"),
    ("fp32", "fp8", "master_fp32_remainders"),
)


@pytest.mark.parametrize("use_dtensor", [False, True], ids=["tensor", "dtensor"])
@pytest.mark.parametrize("exp_avg,exp_avg_sq,master", COMBINATIONS)
def test_offloaded_state_dict_matches_default(exp_avg, exp_avg_sq, master, use_dtensor, request):
    """Every state on CPU, bitwise equal to the default export; live state untouched."""
    mesh = request.getfixturevalue("mesh") if use_dtensor else None
    kwargs = _optimizer_kwargs(exp_avg, exp_avg_sq, master)
    params, opt = _build(dict(kwargs, state_dict_cpu_offload=True), mesh)
    reference = _default_state_dict(opt)
    live = _raw_state(opt)

    offloaded = opt.state_dict()

    _assert_offloaded_equal(offloaded, reference)
    _assert_raw_state_equal(_raw_state(opt), live)
    # FusedAdam creates state for a param without grad too (the frozen one): it is exported.
    assert len(PARAM_SHAPES) in offloaded["state"]
    if master == "master_fp32_remainders":
        for v in offloaded["state"].values():
            assert _local(v["master_param"]).dtype == torch.int16
    for v in offloaded["state"].values():
        for name, t in v.items():
            if name != "master_param" or master != "master_fp32_remainders":
                assert t.dtype == torch.float32

    # A step after the export is the same as one without it.
    params_ref, opt_ref = _build(kwargs, mesh)
    for p, p_ref in zip(params, params_ref):
        assert torch.equal(_local(p), _local(p_ref))
    _set_grads(params, 10)
    _set_grads(params_ref, 10)
    opt.step()
    opt_ref.step()
    for p, p_ref in zip(params, params_ref):
        assert torch.equal(_local(p), _local(p_ref))
    _assert_raw_state_equal(_raw_state(opt), _remap(_raw_state(opt_ref), opt_ref, opt), False)


def _remap(snapshot, opt_from, opt_to):
    """Re-key a raw snapshot of `opt_from` by the matching params of `opt_to`."""
    ids = {}
    for g_from, g_to in zip(opt_from.param_groups, opt_to.param_groups):
        for p_from, p_to in zip(g_from["params"], g_to["params"]):
            ids[id(p_from)] = id(p_to)
    return {(ids[key[0]],) + key[1:]: value for key, value in snapshot.items()}


@pytest.mark.parametrize("use_dtensor", [False, True], ids=["tensor", "dtensor"])
@pytest.mark.parametrize(
    "exp_avg,exp_avg_sq,master",
    _cases(("bf16", "bf16", "master_fp32"), ("fp16", "fp8", "master_fp16")),
)
def test_load_offloaded_state_dict(exp_avg, exp_avg_sq, master, use_dtensor, request):
    """Loading a CPU export gives bitwise the state and training of loading the default one."""
    mesh = request.getfixturevalue("mesh") if use_dtensor else None
    kwargs = _optimizer_kwargs(exp_avg, exp_avg_sq, master)
    params, opt = _build(dict(kwargs, state_dict_cpu_offload=True), mesh)
    offloaded = opt.state_dict()
    reference = _default_state_dict(opt)
    exported = _raw_state(opt)

    runs = []
    for sd in (offloaded, reference):
        new_params, new_opt = _build(kwargs, mesh, steps=0)
        with torch.no_grad():
            for p_new, p in zip(new_params, params):
                _local(p_new).copy_(_local(p))
        new_opt.load_state_dict(sd)
        loaded = _raw_state(new_opt)
        for step in range(3):
            _set_grads(new_params, 20 + step)
            new_opt.step()
        runs.append((new_params, new_opt, loaded))

    (params_a, opt_a, loaded_a), (params_b, opt_b, loaded_b) = runs
    _assert_raw_state_equal(loaded_a, _remap(loaded_b, opt_b, opt_a), same_objects=False)
    for p_a, p_b in zip(params_a, params_b):
        assert torch.equal(_local(p_a), _local(p_b))
    _assert_raw_state_equal(_raw_state(opt_a), _remap(_raw_state(opt_b), opt_b, opt_a), False)
    # Lossless states come back exactly as they were stored.
    if exp_avg == exp_avg_sq and exp_avg in ("fp32", "bf16"):
        _assert_raw_state_equal(loaded_a, _remap(exported, opt, opt_a), same_objects=False)


@pytest.mark.parametrize("moments", ["fp32", "bf16"])
def test_capturable(moments):
    """capturable=True: lr and step stay tensors in param_groups, states go to CPU."""
    kwargs = _optimizer_kwargs(moments, moments, "master_fp32", capturable=True)
    _, opt = _build(dict(kwargs, state_dict_cpu_offload=True))
    reference = _default_state_dict(opt)
    live = _raw_state(opt)
    _assert_offloaded_equal(opt.state_dict(), reference)
    _assert_raw_state_equal(_raw_state(opt), live)


@pytest.mark.parametrize("use_dtensor", [False, True], ids=["tensor", "dtensor"])
def test_never_stepped(use_dtensor, request):
    """An optimizer that never stepped exports no state, like the default path."""
    mesh = request.getfixturevalue("mesh") if use_dtensor else None
    kwargs = _optimizer_kwargs("bf16", "bf16", "master_fp32")
    _, opt = _build(dict(kwargs, state_dict_cpu_offload=True), mesh, steps=0)
    reference = _default_state_dict(opt)
    offloaded = opt.state_dict()
    assert offloaded["state"] == {} == reference["state"]
    _assert_param_groups_equal(offloaded["param_groups"], reference["param_groups"])


def test_default_is_off():
    """The option defaults to False, and then state_dict() keeps states on GPU."""
    _, opt = _build(_optimizer_kwargs("bf16", "bf16", "master_fp32"))
    assert opt.state_dict_cpu_offload is False
    for v in opt.state_dict()["state"].values():
        for t in v.values():
            assert t.is_cuda


@pytest.mark.parametrize("value", [1, 0, "yes", None, torch.tensor(True)])
def test_invalid_option_rejected(value):
    """A value that is not a bool is rejected at construction."""
    params = _make_params([(4,)], torch.bfloat16)
    with pytest.raises(RuntimeError, match="state_dict_cpu_offload"):
        FusedAdam(params, state_dict_cpu_offload=value)


def _big_optimizer(total_numel, largest_numel, exp_avg, offload):
    """BF16 params totalling `total_numel` elements, the largest of `largest_numel`."""
    sizes = [largest_numel]
    rest = total_numel - largest_numel
    while rest > 0:
        sizes.append(min(rest, largest_numel))
        rest -= sizes[-1]
    params = [
        torch.nn.Parameter(torch.randn(n, device="cuda", dtype=torch.bfloat16)) for n in sizes
    ]
    kwargs = _optimizer_kwargs(exp_avg, exp_avg, "master_fp32")
    opt = FusedAdam(params, state_dict_cpu_offload=offload, **kwargs)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    for p in params:
        p.grad = None
    return params, opt


def _host_pinned_bytes():
    stats = torch.cuda.host_memory_stats()
    for key in ("allocated_bytes.current", "allocated_bytes.all.current", "reserved_bytes.current"):
        if key in stats:
            return stats[key]
    pytest.skip(f"torch.cuda.host_memory_stats() has no allocated bytes: {sorted(stats)}")
    return None


def _memory_snapshot():
    """(GPU bytes allocated, pinned host bytes allocated), after collecting garbage."""
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated(), _host_pinned_bytes()


def test_repeated_exports_do_not_grow_memory():
    """20 exports in a row leave GPU and pinned host memory where the first one left them."""
    _, opt = _big_optimizer(2**24, 2**22, "bf16", offload=True)
    opt.state_dict()
    gpu_before, pinned_before = _memory_snapshot()
    for _ in range(20):
        sd = opt.state_dict()
        del sd
    gpu_after, pinned_after = _memory_snapshot()
    assert gpu_after == gpu_before
    assert pinned_after == pinned_before


@pytest.mark.skipif(os.cpu_count() < 2, reason="needs several CPUs")
def test_offload_under_torchrun_thread_settings():
    """With one intra-op thread, as torchrun sets, the export is the same."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _, opt = _build(
            dict(_optimizer_kwargs("fp16", "bf16", "master_fp32"), state_dict_cpu_offload=True)
        )
        _assert_offloaded_equal(opt.state_dict(), _default_state_dict(opt))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "cpus, node_cpus, threads, local_world_size, workers",
    [
        (16, 16, 16, None, 4),  # torch's default threads
        (16, 16, 1, None, 16),  # OMP_NUM_THREADS=1
        (64, 64, 1, None, 16),  # at most 16
        (2, 2, 2, None, 1),
        (128, 128, 1, "8", 16),  # 8 ranks that share the node's CPUs
        (32, 32, 1, "8", 4),
        (16, 128, 1, "8", 16),  # 8 ranks, each bound to CPUs of its own
        (16, 16, 1, "many", 16),  # not a number: one process
    ],
)
def test_offload_worker_count(monkeypatch, cpus, node_cpus, threads, local_world_size, workers):
    """The CPU threads of an export: the CPUs of this process (shared with the other ranks of
    the node unless it is bound to its own) over its intra-op threads, up to 4, at most 16."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: node_cpus)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    if local_world_size is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world_size)
    assert fused_adam._state_dict_offload_workers() == workers


# Loading with state_dict_cpu_offload=True: bounded GPU memory, the values of the default path.


def _clone_state_dict(sd):
    """A copy of a state dict whose tensors cannot change with the original's, on their
    devices (DTensor.from_local would move a CPU local tensor to the GPU)."""
    return {
        "state": {
            k: {
                name: (
                    DTensor(t._local_tensor.clone(), t._spec, requires_grad=False)
                    if isinstance(t, DTensor)
                    else t.clone()
                )
                for name, t in v.items()
            }
            for k, v in sd["state"].items()
        },
        "param_groups": copy.deepcopy(sd["param_groups"]),
    }


def _assert_state_dicts_equal(actual, expected):
    _assert_param_groups_equal(actual["param_groups"], expected["param_groups"])
    assert actual["state"].keys() == expected["state"].keys()
    for k, v in expected["state"].items():
        assert actual["state"][k].keys() == v.keys()
        for name, t in v.items():
            a = actual["state"][k][name]
            assert type(a) is type(t) and _local(a).device == _local(t).device, (k, name)
            assert torch.equal(_local(a), _local(t)), (k, name)


def _live_groups(opt):
    """param_groups without the parameters, for comparing two optimizers."""
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def _load_both_ways(kwargs, mesh, sd, params, target_steps):
    """Load `sd` with the bounded path and with the default path, each into a new optimizer
    that holds the state of `target_steps` other steps, then train both. The default path
    gets its own copy of `sd`, since it may scale a GPU state in place."""
    runs = []
    for offload in (True, False):
        new_params, new_opt = _build(
            dict(kwargs, state_dict_cpu_offload=offload), mesh, steps=target_steps
        )
        with torch.no_grad():
            for p_new, p in zip(new_params, params):
                _local(p_new).copy_(_local(p))
        source = sd if offload else _clone_state_dict(sd)
        new_opt.load_state_dict(source)
        loaded = _raw_state(new_opt), _live_groups(new_opt)
        for step in range(3):
            _set_grads(new_params, 20 + step)
            new_opt.step()
        runs.append((new_params, new_opt, loaded))
    (params_a, opt_a, loaded_a), (params_b, opt_b, loaded_b) = runs
    _assert_raw_state_equal(loaded_a[0], _remap(loaded_b[0], opt_b, opt_a), same_objects=False)
    _assert_param_groups_equal(loaded_a[1], loaded_b[1])
    for p_a, p_b in zip(params_a, params_b):
        assert torch.equal(_local(p_a), _local(p_b))
    _assert_raw_state_equal(_raw_state(opt_a), _remap(_raw_state(opt_b), opt_b, opt_a), False)
    return opt_a


@pytest.mark.parametrize("source", ["cpu", "gpu"])
@pytest.mark.parametrize("use_dtensor", [False, True], ids=["tensor", "dtensor"])
@pytest.mark.parametrize("exp_avg,exp_avg_sq,master", COMBINATIONS)
def test_bounded_load_matches_default_load(
    exp_avg, exp_avg_sq, master, use_dtensor, source, request
):
    """With the option, load_state_dict() gives bitwise the state and training of the default
    path, from a CPU export and from a GPU one, into an optimizer that already holds state;
    the state dict is not changed."""
    mesh = request.getfixturevalue("mesh") if use_dtensor else None
    kwargs = _optimizer_kwargs(exp_avg, exp_avg_sq, master)
    params, opt = _build(dict(kwargs, state_dict_cpu_offload=True), mesh)
    sd = opt.state_dict() if source == "cpu" else _default_state_dict(opt)
    before = _clone_state_dict(sd)
    _load_both_ways(kwargs, mesh, sd, params, target_steps=1)
    _assert_state_dicts_equal(sd, before)


@pytest.mark.parametrize("use_dtensor", [False, True], ids=["tensor", "dtensor"])
@pytest.mark.parametrize(
    "exp_avg,exp_avg_sq,master",
    _cases(
        ("bf16", "bf16", "master_fp32"),
        ("fp8", "fp16", "master_fp16"),
        ("fp32", "fp8", "no_master"),
    ),
)
def test_bounded_load_into_new_optimizer(exp_avg, exp_avg_sq, master, use_dtensor, request):
    """An optimizer that never stepped loads as with the default path; so does a state dict
    in which a parameter has no state."""
    mesh = request.getfixturevalue("mesh") if use_dtensor else None
    kwargs = _optimizer_kwargs(exp_avg, exp_avg_sq, master)
    params, opt = _build(dict(kwargs, state_dict_cpu_offload=True), mesh)
    sd = opt.state_dict()
    _load_both_ways(kwargs, mesh, sd, params, target_steps=0)
    sd["state"][1] = {}
    opt_a = _load_both_ways(kwargs, mesh, sd, params, target_steps=2)
    assert len(opt_a.state[opt_a.param_groups[0]["params"][1]]) > 0  # made again by step()


def _bad_last_state(name, value):
    def change(sd):
        sd["state"][max(sd["state"])][name] = value(sd["state"][max(sd["state"])])

    return change


def _drop_group_param(sd):
    sd["param_groups"][0]["params"].pop()


def _add_group(sd):
    sd["param_groups"].append(dict(sd["param_groups"][-1], params=[]))


def _remove_state(sd):
    del sd["state"][max(sd["state"])]["exp_avg_sq"]


def _not_a_dict(sd):
    sd["state"][max(sd["state"])] = [1, 2]


MISMATCHES = {
    "groups": (_add_group, ValueError, "number of parameter groups"),
    "group_size": (_drop_group_param, ValueError, "size of optimizer's group"),
    "missing_state": (_remove_state, RuntimeError, "expected the states"),
    "extra_state": (
        _bad_last_state("step", lambda v: torch.tensor(3.0)),
        RuntimeError,
        "expected the states",
    ),
    "not_a_dict": (_not_a_dict, RuntimeError, "expected a dict"),
    "not_a_tensor": (_bad_last_state("exp_avg", lambda v: [0.0]), RuntimeError, "to be a tensor"),
    "shape": (
        _bad_last_state("exp_avg", lambda v: torch.zeros(3)),
        RuntimeError,
        "of shape",
    ),
    "dtype": (
        _bad_last_state("exp_avg", lambda v: v["exp_avg"].bfloat16()),
        RuntimeError,
        "dtype",
    ),
    "gpu_layout": (
        _bad_last_state("exp_avg", lambda v: v["exp_avg"].cuda().t().contiguous().t()),
        RuntimeError,
        "dense",
    ),
    "remainders": (
        _bad_last_state("master_param", lambda v: v["master_param"].view(torch.int16)[..., ::2]),
        RuntimeError,
        "dtype",
    ),
}


@pytest.mark.parametrize("mismatch", sorted(MISMATCHES))
@requires_fp8
def test_bounded_load_rejects_mismatch(mismatch):
    """A state dict that does not fit the optimizer raises and changes nothing."""
    change, error, match = MISMATCHES[mismatch]
    kwargs = _optimizer_kwargs("fp8", "bf16", "master_fp32")
    params, opt = _build(dict(kwargs, state_dict_cpu_offload=True))
    sd = opt.state_dict()
    change(sd)
    _, target = _build(dict(kwargs, state_dict_cpu_offload=True), steps=1)
    live, groups = _raw_state(target), _live_groups(target)
    with pytest.raises(error, match=match):
        target.load_state_dict(sd)
    _assert_raw_state_equal(_raw_state(target), live)
    _assert_param_groups_equal(_live_groups(target), groups)
    assert not target._optimizer_load_state_dict_pre_hooks
    assert not target._optimizer_load_state_dict_post_hooks
    del params


@requires_fp8
def test_bounded_load_non_contiguous_cpu_values():
    """CPU values in another memory order load as their contiguous copies do."""
    kwargs = _optimizer_kwargs("fp8", "bf16", "master_fp16")
    params, opt = _build(dict(kwargs, state_dict_cpu_offload=True))
    sd = opt.state_dict()
    strided = _clone_state_dict(sd)
    for v in strided["state"].values():
        for name, t in v.items():
            if t.dim() == 2:
                v[name] = t.t().contiguous().t()
                assert not v[name].is_contiguous()
    loaded = []
    for source in (sd, strided):
        _, target = _build(dict(kwargs, state_dict_cpu_offload=True), steps=1)
        target.load_state_dict(source)
        loaded.append((target, _raw_state(target)))
    (opt_a, raw_a), (opt_b, raw_b) = loaded
    _assert_raw_state_equal(raw_a, _remap(raw_b, opt_b, opt_a), same_objects=False)
    del params


def test_bounded_load_rejects_dtensor_mismatch(mesh):
    """A DTensor state with other placements than its parameter's is rejected."""
    kwargs = _optimizer_kwargs("bf16", "bf16", "master_fp32")
    _, opt = _build(dict(kwargs, state_dict_cpu_offload=True), mesh)
    sd = opt.state_dict()
    state = sd["state"][0]["exp_avg"]  # parameter 0 is Shard(0)
    sd["state"][0]["exp_avg"] = DTensor(
        state._local_tensor,
        state._spec.__class__(state.device_mesh, (Replicate(),), state._spec.tensor_meta),
        requires_grad=False,
    )
    _, target = _build(dict(kwargs, state_dict_cpu_offload=True), mesh, steps=1)
    live = _raw_state(target)
    with pytest.raises(RuntimeError, match="placements"):
        target.load_state_dict(sd)
    _assert_raw_state_equal(_raw_state(target), live)


@requires_fp8
def test_bounded_load_hooks():
    """Pre-hooks run first and what they return is loaded; post-hooks see the loaded state,
    as with torch.optim.Optimizer."""
    kwargs = _optimizer_kwargs("bf16", "fp8", "master_fp32")
    params, opt = _build(dict(kwargs, state_dict_cpu_offload=True))
    sd = opt.state_dict()
    _, target = _build(dict(kwargs, state_dict_cpu_offload=True), steps=1)
    seen = {}

    def pre_hook(optimizer, state_dict):
        assert optimizer is target and state_dict["state"].keys() == sd["state"].keys()
        changed = _clone_state_dict(state_dict)
        changed["param_groups"][0]["lr"] = 0.5
        changed["state"][0]["exp_avg"].fill_(0.25)
        return changed

    def post_hook(optimizer):
        seen["state"] = _raw_state(optimizer)

    target.register_load_state_dict_pre_hook(pre_hook)
    target.register_load_state_dict_post_hook(post_hook)
    target.load_state_dict(sd)
    assert target.param_groups[0]["lr"] == 0.5
    exp_avg = target.state[target.param_groups[0]["params"][0]]["exp_avg"]
    assert torch.equal(exp_avg, torch.full_like(exp_avg, 0.25))
    _assert_raw_state_equal(seen["state"], _raw_state(target))
    assert len(target._optimizer_load_state_dict_pre_hooks) == 1
    assert len(target._optimizer_load_state_dict_post_hooks) == 1
    del params


# Failures in the middle of an export or a load: nothing is left behind, nothing is lost.


def _fail_on_call(monkeypatch, owner, name, call, error):
    """Make the `call`-th call of `owner.name` raise `error`; the calls before it run."""
    original = getattr(owner, name)
    calls = []

    def failing(*args, **kwargs):
        calls.append(None)
        if len(calls) == call:
            raise error
        return original(*args, **kwargs)

    static = isinstance(inspect.getattr_static(owner, name), staticmethod)
    monkeypatch.setattr(owner, name, staticmethod(failing) if static else failing)
    return calls


def _staging_threads():
    return [t for t in threading.enumerate() if t.name.startswith("FusedAdamStateDict")]


# name: (object, attribute, failing call, error). The export of 16 parameters of 2^21 elements
# (BF16 moments, FP32 master weights) has 48 states, 256 MiB in 64 pieces of 4 MiB (the size
# of the export's pinned buffers in these tests).
EXPORT_FAULTS = {
    "output_allocation": (torch, "empty_like", 20, MemoryError("injected: CPU allocation")),
    "pinned_allocation": (torch, "empty", 3, RuntimeError("injected: pinned allocation")),
    "worker": (fused_adam._StateStaging, "_work", 30, RuntimeError("injected: CPU thread")),
    "copy": (fused_adam._StateStaging, "add", 50, RuntimeError("injected: copy to CPU")),
}

# As above, for loading that export into an optimizer that holds other state.
LOAD_FAULTS = {
    "state_allocation": (
        torch,
        "empty_like",
        20,
        torch.cuda.OutOfMemoryError("injected: CUDA out of memory"),
    ),
    "worker": (fused_adam._StateStaging, "_work", 30, RuntimeError("injected: CPU thread")),
    "copy": (fused_adam._StateStaging, "_retire", 50, RuntimeError("injected: copy to GPU")),
}


@pytest.mark.parametrize("fault", sorted(EXPORT_FAULTS))
def test_failed_export_leaves_nothing_behind(fault, monkeypatch):
    """An exception in the middle of an offloaded state_dict() propagates, stops the threads,
    releases the pinned buffers and GPU memory, and leaves the live state as it was."""
    monkeypatch.setattr(fused_adam, "_STATE_DICT_OFFLOAD_CHUNK_BYTES", 4 * 1024**2)
    _, opt = _big_optimizer(2**25, 2**21, "bf16", offload=True)
    reference = _default_state_dict(opt)
    live = _raw_state(opt)
    opt.state_dict()  # the pinned buffers are cached by torch from here on
    before = _memory_snapshot()
    owner, name, call, error = EXPORT_FAULTS[fault]
    calls = _fail_on_call(monkeypatch, owner, name, call, error)
    with pytest.raises(type(error), match="injected"):
        opt.state_dict()
    monkeypatch.undo()
    assert len(calls) >= call
    assert not _staging_threads()
    assert _memory_snapshot() == before
    _assert_raw_state_equal(_raw_state(opt), live)
    _assert_offloaded_equal(opt.state_dict(), reference)


@pytest.mark.parametrize("fault", sorted(LOAD_FAULTS))
def test_failed_load_raises_until_a_load_succeeds(fault, monkeypatch):
    """An exception after the old states were released propagates, stops the threads and
    releases the pinned buffers; step() and state_dict() then raise instead of training on
    incomplete states, until a load succeeds, which gives the state of a clean load."""
    params, opt = _big_optimizer(2**25, 2**21, "bf16", offload=True)
    sd = opt.state_dict()
    target_params, target = _big_optimizer(2**25, 2**21, "bf16", offload=True)
    target.load_state_dict(sd)  # the pinned buffers are cached by torch from here on
    clean = _raw_state(target)
    before = _memory_snapshot()
    owner, name, call, error = LOAD_FAULTS[fault]
    calls = _fail_on_call(monkeypatch, owner, name, call, error)
    with pytest.raises(type(error), match="injected"):
        target.load_state_dict(sd)
    monkeypatch.undo()
    assert len(calls) >= call
    assert not _staging_threads()
    assert _memory_snapshot()[1] == before[1]
    for p in target_params:
        p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match="load_state_dict.* failed .*injected"):
        target.step()
    with pytest.raises(RuntimeError, match="load_state_dict.* failed .*injected"):
        target.state_dict()

    target.load_state_dict(sd)
    _assert_raw_state_equal(_raw_state(target), clean, same_objects=False)
    with torch.no_grad():
        for p, p_target in zip(params, target_params):
            p_target.copy_(p)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    target.step()
    for p, p_target in zip(params, target_params):
        assert torch.equal(p, p_target)


@requires_fp8
def test_failed_load_then_default_load(monkeypatch):
    """After a failed bounded load, a load with the default path also makes the optimizer
    usable again."""
    _, opt = _build(
        dict(_optimizer_kwargs("fp8", "bf16", "master_fp32"), state_dict_cpu_offload=True)
    )
    sd = opt.state_dict()
    _, target = _build(
        dict(_optimizer_kwargs("fp8", "bf16", "master_fp32"), state_dict_cpu_offload=True), steps=1
    )
    _fail_on_call(monkeypatch, fused_adam._StateStaging, "_work", 1, RuntimeError("injected"))
    with pytest.raises(RuntimeError, match="injected"):
        target.load_state_dict(sd)
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="load_state_dict"):
        target.state_dict()
    target.state_dict_cpu_offload = False
    target.load_state_dict(sd)
    target.step()


@pytest.mark.parametrize("module_path", ["torch>=2.5", "torch 2.4"])
def test_dtensor_states_through_either_module_path(module_path, mesh, monkeypatch):
    """The private DTensorSpec is imported when a DTensor state is exported, from where
    PyTorch 2.5+ has it, or else from where PyTorch 2.4 has it: both give the same export."""
    importlib.import_module("torch.distributed._tensor.placement_types")  # before blocking
    if module_path == "torch 2.4":
        monkeypatch.setitem(sys.modules, "torch.distributed.tensor._dtensor_spec", None)
    kwargs = _optimizer_kwargs("fp16", "bf16", "master_fp32")
    _, opt = _build(dict(kwargs, state_dict_cpu_offload=True), mesh)
    reference = _default_state_dict(opt)
    _assert_offloaded_equal(opt.state_dict(), reference)
