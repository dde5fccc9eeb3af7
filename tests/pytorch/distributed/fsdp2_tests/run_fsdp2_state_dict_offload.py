#!/usr/bin/python3

# Copyright (c) 2022-2026, NVIDIA CORPORATION & AFFILIATES. All rights reserved.
#
# See LICENSE for license information.

"""FSDP2 + DCP checks of FusedAdam(state_dict_cpu_offload=True).

Run one test for some variants on all local GPUs (the pytest launcher
test_fused_adam_state_dict_offload_dcp.py runs them all):
  torchrun --nproc_per_node=2 run_fsdp2_state_dict_offload.py --test export \\
      --variant bf16 fp8 --offload 1 0 --ckpt-dir /tmp/ckpt

--test:
  export          get_optimizer_state_dict(flatten, cpu_offload): CPU, bitwise equal to the
                  default path, same DTensor metadata, bounded GPU peak; full_state_dict too.
  roundtrip       dcp.save -> fresh model/optimizer -> dcp.load -> continue: losses and params
                  bitwise equal to the default path's run (and, for lossless states, to an
                  uninterrupted run).
  async_sync      as roundtrip, with dcp.async_save and synchronous staging.
  async_async     as roundtrip, with dcp.async_save and asynchronous staging.
  load_memory     save, train on, dcp.load + set_optimizer_state_dict into the same optimizer:
                  GPU peaks, loaded state and later training bitwise equal to the default path.
  reshard_save    train, save a checkpoint and the reference run (with N ranks).
  reshard_load    load that checkpoint (with fewer ranks), continue, compare.
--variant: bf16 (BF16 moments, FP32 master), fp8 (FP8 moments), remainders
  (BF16 moments, store_param_remainders).
--offload: 1 (state_dict_cpu_offload=True) and/or 0 (the default path, as control).
Each (variant, offload) gets its own directory under --ckpt-dir.
"""

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import transformer_engine.pytorch as te

HIDDEN_SIZE = 1024
FFN_HIDDEN_SIZE = 4096
NUM_LAYERS = 2
TOKENS_PER_RANK = 64
STEPS_BEFORE_SAVE = 3
STEPS_AFTER_LOAD = 3
MiB = 1024**2
OFFLOAD_GPU_BOUND_BYTES = 64 * MiB
GLOBAL_BATCH = 4  # batches per step, split over the ranks (any rank count dividing it)

VARIANTS = {
    "bf16": dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16),
    "fp8": dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8),
    "remainders": dict(
        exp_avg_dtype=torch.bfloat16,
        exp_avg_sq_dtype=torch.bfloat16,
        store_param_remainders=True,
    ),
}


def _log(msg):
    if dist.get_rank() == 0:
        print(f"[run_fsdp2_state_dict_offload] {msg}", flush=True)


def _build(seed, variant, offload, mesh):
    """A BF16 TE model sharded with FSDP2 per layer and at the root, and its FusedAdam."""
    torch.manual_seed(seed)
    layers = []
    for _ in range(NUM_LAYERS):
        layers.append(te.LayerNormMLP(HIDDEN_SIZE, FFN_HIDDEN_SIZE, params_dtype=torch.bfloat16))
        layers.append(te.Linear(HIDDEN_SIZE, HIDDEN_SIZE, params_dtype=torch.bfloat16))
    model = torch.nn.Sequential(*layers)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = te.optimizers.FusedAdam(
        model.parameters(),
        lr=1e-3,
        weight_decay=0.01,
        master_weights=True,
        state_dict_cpu_offload=offload,
        **VARIANTS[variant],
    )
    return model, opt


def _train(model, opt, first_step, num_steps):
    """`num_steps` steps; the data of a step depends only on its index and the world."""
    losses = []
    world, rank = dist.get_world_size(), dist.get_rank()
    for step in range(first_step, first_step + num_steps):
        gen = torch.Generator(device="cuda").manual_seed(1000 + step)
        data = torch.randn(
            GLOBAL_BATCH, TOKENS_PER_RANK, HIDDEN_SIZE, generator=gen, device="cuda"
        ).to(torch.bfloat16)
        per_rank = GLOBAL_BATCH // world
        x = data[rank * per_rank : (rank + 1) * per_rank].reshape(-1, HIDDEN_SIZE)
        opt.zero_grad(set_to_none=True)
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
    return losses


def _full_params(model):
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu()
        for name, p in model.named_parameters()
    }


def _assert_same_params(actual, expected, what):
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(actual[name], value), f"{what}: parameter {name} differs"


def _local(t):
    return t._local_tensor if isinstance(t, DTensor) else t


def _peak_gpu(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - before


def _moment_numel(opt):
    """Local elements of the moments of this rank."""
    return sum(_local(state["exp_avg"]).numel() for state in opt.state.values())


def _compare_state_dicts(offloaded, reference, what):
    """Values bitwise, dtypes and DTensor metadata exactly; offloaded tensors on CPU."""
    assert offloaded.keys() == reference.keys(), what
    for key, ref in reference.items():
        out = offloaded[key]
        if not isinstance(ref, torch.Tensor):
            assert out == ref, f"{what}: {key}"
            continue
        assert type(out) is type(ref), f"{what}: {key}: {type(out)} vs {type(ref)}"
        assert out.dtype == ref.dtype, f"{what}: {key}: {out.dtype} vs {ref.dtype}"
        assert out.shape == ref.shape and out.stride() == ref.stride(), f"{what}: {key}"
        if isinstance(ref, DTensor):
            assert out.device_mesh == ref.device_mesh, f"{what}: {key}"
            assert out.placements == ref.placements, f"{what}: {key}"
        assert _local(out).device.type == "cpu", f"{what}: {key} is on {_local(out).device}"
        assert _local(out).shape == _local(ref).shape, f"{what}: {key}"
        assert torch.equal(_local(out), _local(ref).cpu()), f"{what}: {key} differs"


def test_export(variant, offload, mesh, _ckpt_dir):
    """get_optimizer_state_dict(cpu_offload=True): CPU, bitwise, bounded GPU peak."""
    model, opt = _build(0, variant, offload, mesh)
    _train(model, opt, 0, STEPS_BEFORE_SAVE)
    options = StateDictOptions(flatten_optimizer_state_dict=True, cpu_offload=True)

    exported, peak = _peak_gpu(lambda: get_optimizer_state_dict(model, opt, options=options))
    opt.state_dict_cpu_offload = False
    reference, default_peak = _peak_gpu(
        lambda: get_optimizer_state_dict(model, opt, options=options)
    )
    opt.state_dict_cpu_offload = offload
    _compare_state_dicts(exported, reference, "sharded")
    n_dtensor = sum(isinstance(v, DTensor) for v in exported.values())
    assert n_dtensor > 0, "no DTensor state in the sharded export"

    numel = _moment_numel(opt)
    _log(
        f"export {variant} offload={offload}: {n_dtensor} DTensor states, "
        f"{numel} local moment elements; GPU peak +{peak / MiB:.1f} MiB "
        f"(default path +{default_peak / MiB:.1f} MiB)"
    )
    if variant in ("bf16", "remainders"):
        assert default_peak >= 8 * numel, f"default path peaked at only +{default_peak} B"
    if offload:
        assert peak <= OFFLOAD_GPU_BOUND_BYTES, f"offloaded export peaked at +{peak / MiB} MiB"

    # The full state dict (gathered on rank 0) has the same values with both paths. NCCL has
    # no int16, so DCP cannot gather the remainders of store_param_remainders on either path.
    if variant == "remainders":
        return
    full_options = StateDictOptions(
        flatten_optimizer_state_dict=True, full_state_dict=True, cpu_offload=True
    )
    full = get_optimizer_state_dict(model, opt, options=full_options)
    opt.state_dict_cpu_offload = False
    full_reference = get_optimizer_state_dict(model, opt, options=full_options)
    opt.state_dict_cpu_offload = offload
    if dist.get_rank() == 0:
        _compare_state_dicts(full, full_reference, "full")
        assert not any(isinstance(v, DTensor) for v in full.values())


def _save(model, opt, ckpt_dir, mode):
    options = StateDictOptions(flatten_optimizer_state_dict=True, cpu_offload=True)
    state = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, opt, options=options),
    }
    if mode == "sync":
        dcp.save(state, checkpoint_id=ckpt_dir)
        return
    # pylint: disable=import-outside-toplevel
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = DefaultStager(StagingOptions(use_async_staging=mode == "async_async"))
    response = dcp.async_save(state, checkpoint_id=ckpt_dir, async_stager=stager)
    if hasattr(response, "upload_completion"):
        response.staging_completion.result()
        response.upload_completion.result()
    else:
        response.result()
    if hasattr(stager, "close"):
        stager.close()


def _load(model, opt, ckpt_dir):
    options = StateDictOptions(flatten_optimizer_state_dict=True, cpu_offload=True)
    state = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, opt, options=options),
    }
    dcp.load(state, checkpoint_id=ckpt_dir)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(
        model, opt, state["optim"], options=StateDictOptions(flatten_optimizer_state_dict=True)
    )


def _resumed_run(variant, offload, mesh, ckpt_dir, mode):
    model, opt = _build(0, variant, offload, mesh)
    losses = _train(model, opt, 0, STEPS_BEFORE_SAVE)
    _save(model, opt, ckpt_dir, mode)
    del model, opt
    model, opt = _build(1, variant, offload, mesh)  # a different init: the load must matter
    _load(model, opt, ckpt_dir)
    losses += _train(model, opt, STEPS_BEFORE_SAVE, STEPS_AFTER_LOAD)
    return losses, _full_params(model)


def _roundtrip(variant, offload, mesh, ckpt_dir, mode):
    losses, params = _resumed_run(variant, offload, mesh, os.path.join(ckpt_dir, "a"), mode)
    # Control: the same resumed run through the default path (bitwise, for every variant).
    ref_losses, ref_params = _resumed_run(variant, False, mesh, os.path.join(ckpt_dir, "b"), "sync")
    assert losses == ref_losses, f"losses {losses} != default path {ref_losses}"
    _assert_same_params(params, ref_params, "resumed vs default-path resumed")
    # FP32 master weights and BF16 moments survive the checkpoint exactly, so the resumed
    # run also equals the uninterrupted run. (FP8 moments are requantized on load.)
    model, opt = _build(0, variant, offload, mesh)
    straight = _train(model, opt, 0, STEPS_BEFORE_SAVE + STEPS_AFTER_LOAD)
    if variant != "fp8":
        assert losses == straight, f"losses {losses} != uninterrupted {straight}"
        _assert_same_params(params, _full_params(model), "resumed vs uninterrupted")
    _log(f"{mode} {variant} offload={offload}: losses {losses}")


def test_roundtrip(variant, offload, mesh, ckpt_dir):
    """Sharded dcp.save -> fresh model -> dcp.load -> continue."""
    _roundtrip(variant, offload, mesh, ckpt_dir, "sync")


def test_async_sync(variant, offload, mesh, ckpt_dir):
    """dcp.async_save with synchronous staging."""
    _roundtrip(variant, offload, mesh, ckpt_dir, "async_sync")


def test_async_async(variant, offload, mesh, ckpt_dir):
    """dcp.async_save with asynchronous staging."""
    _roundtrip(variant, offload, mesh, ckpt_dir, "async_async")


def _full_optim_state(model, opt):
    options = StateDictOptions(
        flatten_optimizer_state_dict=True, full_state_dict=True, cpu_offload=True
    )
    return get_optimizer_state_dict(model, opt, options=options)


def test_reshard_save(variant, offload, mesh, ckpt_dir):
    """Phase 1 of resharding: train, save through this path and through the default one."""
    model, opt = _build(0, variant, offload, mesh)
    _train(model, opt, 0, STEPS_BEFORE_SAVE)
    _save(model, opt, os.path.join(ckpt_dir, "ckpt"), "sync")
    opt.state_dict_cpu_offload = False
    _save(model, opt, os.path.join(ckpt_dir, "ckpt_default"), "sync")
    params = _full_params(model)
    optim = None if variant == "remainders" else _full_optim_state(model, opt)
    if dist.get_rank() == 0:
        torch.save(
            {"params": params, "optim": optim, "world": dist.get_world_size()},
            os.path.join(ckpt_dir, "saved.pt"),
        )
    _log(f"reshard_save {variant} offload={offload}: saved with {dist.get_world_size()} ranks")


def test_reshard_load(variant, offload, mesh, ckpt_dir):
    """Phase 2 of resharding: load with another rank count, check, continue, compare."""
    saved = torch.load(os.path.join(ckpt_dir, "saved.pt"), weights_only=False)
    assert saved["world"] != dist.get_world_size(), "resharding needs another rank count"
    runs = []
    for name in ("ckpt", "ckpt_default"):
        model, opt = _build(1, variant, offload, mesh)
        _load(model, opt, os.path.join(ckpt_dir, name))
        optim = None if saved["optim"] is None else _full_optim_state(model, opt)
        loaded = _full_params(model), optim
        losses = _train(model, opt, STEPS_BEFORE_SAVE, STEPS_AFTER_LOAD)
        runs.append((loaded, losses, _full_params(model)))
    (loaded, losses, params), (ref_loaded, ref_losses, ref_params) = runs
    # What was loaded is what was saved, with every rank count. (With cpu_offload, the full
    # optimizer state is gathered on rank 0 only.)
    _assert_same_params(loaded[0], saved["params"], "loaded vs saved")
    if dist.get_rank() == 0 and saved["optim"] is not None:
        _compare_full(loaded[1], ref_loaded[1], "loaded optimizer state vs default path")
        if variant != "fp8":  # FP8 moments are requantized on load
            _compare_full(loaded[1], saved["optim"], "loaded optimizer state vs saved")
    # Training continues as it does from the default path's checkpoint.
    assert losses == ref_losses, f"losses {losses} != default path {ref_losses}"
    _assert_same_params(params, ref_params, "resharded vs default-path resharded")
    _log(
        f"reshard_load {variant} offload={offload}: {saved['world']} -> "
        f"{dist.get_world_size()} ranks, losses {losses}"
    )


def _compare_full(actual, expected, what):
    assert actual.keys() == expected.keys(), what
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert actual[key].dtype == value.dtype, f"{what}: {key}"
            assert torch.equal(actual[key].cpu(), value.cpu()), f"{what}: {key} differs"
        else:
            assert actual[key] == value, f"{what}: {key}"


def _local_state(opt):
    """The stored bytes of this rank's optimizer states (FP8: data, transpose, scale_inv)."""
    snapshot = []
    for group in opt.param_groups:
        for p in group["params"]:
            for name, value in sorted(opt.state[p].items()):
                local = _local(value)
                parts = [local]
                if hasattr(local, "_data"):
                    parts = [local._data, local._transpose, local._scale_inv]
                snapshot += [(name, t.detach().cpu().clone()) for t in parts if t is not None]
            for name, scale in sorted(opt._scales.get(p, {}).items()):
                snapshot.append((name + " scale", scale.cpu().clone()))
    return snapshot


def _resume_in_place(variant, offload, mesh, ckpt_dir):
    """Train, save, train on, then load the checkpoint into the same optimizer (which holds
    state, as in a resume after a failed step) and continue."""
    model, opt = _build(0, variant, offload, mesh)
    _train(model, opt, 0, STEPS_BEFORE_SAVE)
    _save(model, opt, ckpt_dir, "sync")
    _train(model, opt, STEPS_BEFORE_SAVE, 1)
    options = StateDictOptions(flatten_optimizer_state_dict=True, cpu_offload=True)
    state = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, opt, options=options),
    }
    _, dcp_peak = _peak_gpu(lambda: dcp.load(state, checkpoint_id=ckpt_dir))
    set_model_state_dict(model, state["model"])
    before = torch.cuda.memory_allocated()
    _, set_peak = _peak_gpu(
        lambda: set_optimizer_state_dict(
            model, opt, state["optim"], options=StateDictOptions(flatten_optimizer_state_dict=True)
        )
    )
    above_loaded = before + set_peak - torch.cuda.memory_allocated()
    loaded = _local_state(opt)
    losses = _train(model, opt, STEPS_BEFORE_SAVE, STEPS_AFTER_LOAD)
    return dcp_peak, above_loaded, _moment_numel(opt), loaded, losses


def test_load_memory(variant, offload, mesh, ckpt_dir):
    """dcp.load + set_optimizer_state_dict into an optimizer that holds state: bounded GPU
    peak, and the loaded state and later training bitwise equal to the default path's."""
    if not offload:
        return  # the default path is this test's control
    dcp_peak, above, numel, loaded, losses = _resume_in_place(
        variant, True, mesh, os.path.join(ckpt_dir, "a")
    )
    ref_dcp_peak, ref_above, _, ref_loaded, ref_losses = _resume_in_place(
        variant, False, mesh, os.path.join(ckpt_dir, "b")
    )
    _log(
        f"load {variant}: {numel} local moment elements; GPU peak during dcp.load "
        f"+{dcp_peak / MiB:.1f} MiB (default path +{ref_dcp_peak / MiB:.1f} MiB), during "
        f"set_optimizer_state_dict +{above / MiB:.1f} MiB above the loaded state (default path "
        f"+{ref_above / MiB:.1f} MiB)"
    )
    assert [n for n, _ in loaded] == [n for n, _ in ref_loaded]
    for (name, value), (_, ref) in zip(loaded, ref_loaded):
        assert value.dtype == ref.dtype and torch.equal(value, ref), f"loaded {name} differs"
    assert losses == ref_losses, f"losses {losses} != default path {ref_losses}"
    assert above <= OFFLOAD_GPU_BOUND_BYTES, f"set_optimizer_state_dict: +{above / MiB} MiB"
    assert dcp_peak <= OFFLOAD_GPU_BOUND_BYTES, f"dcp.load: +{dcp_peak / MiB} MiB"


TESTS = {
    "export": test_export,
    "load_memory": test_load_memory,
    "roundtrip": test_roundtrip,
    "async_sync": test_async_sync,
    "async_async": test_async_async,
    "reshard_save": test_reshard_save,
    "reshard_load": test_reshard_load,
}


def main():
    """Run the cases on this rank; a failure raises, so torchrun exits non-zero."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--test", choices=sorted(TESTS), required=True)
    parser.add_argument("--variant", nargs="+", choices=sorted(VARIANTS), default=["bf16"])
    parser.add_argument("--offload", nargs="+", type=int, choices=[0, 1], default=[1])
    parser.add_argument("--ckpt-dir", required=True)
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(
        backend="cpu:gloo,cuda:nccl",  # async_save needs a CPU backend
        device_id=torch.device("cuda", local_rank),
        timeout=datetime.timedelta(seconds=120),
    )
    world = dist.get_world_size()
    if GLOBAL_BATCH % world != 0:
        raise RuntimeError(f"{world} ranks do not divide the global batch of {GLOBAL_BATCH}")
    mesh = init_device_mesh("cuda", (world,))
    try:
        for variant in args.variant:
            for offload in args.offload:
                ckpt_dir = os.path.join(args.ckpt_dir, f"{variant}-offload{offload}")
                if dist.get_rank() == 0:
                    os.makedirs(ckpt_dir, exist_ok=True)
                dist.barrier()
                TESTS[args.test](variant, bool(offload), mesh, ckpt_dir)
                dist.barrier()
                _log(f"PASSED {args.test} variant={variant} offload={offload} world={world}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
