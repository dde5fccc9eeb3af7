"""A check, on a GPU, that FusedAdam(state_dict_cpu_offload=True) works in this Python:

    python -m te_fusedadam_offload.gpu_check            # about 2^27 elements; --log2 N for 2^N

It makes a FusedAdam with FP32 master weights and BF16 moments over 2^N BF16 parameter elements
(four tensors) on the current GPU, takes two steps, and exports the state dict twice from the
same states: as TE does by default (state_dict_cpu_offload set to False for the call), then
each tensor copied to CPU as DCP's cpu_offload does; then with the option. It prints the GPU
memory each export took (its peak above the memory allocated before) and its time, both of
the states from the optimizer to CPU, and whether the option's export is bitwise the default one
(the same keys, param_groups, dtypes and bits, on CPU). Exit status: 0 if it is and the
option's export took no GPU memory (as for BF16 and FP32 states it should); 1 if not, or if
the TE that this Python imports has no state_dict_cpu_offload (the series is not applied:
te-fusedadam-offload apply --installed); 4 if it cannot run here (no torch, no CUDA GPU, TE
not importable). It uses a few GiB of GPU and host memory at the default size.
"""

import argparse
import inspect
import sys
import time

MiB = 2**20


def differences(expected, actual):
    """What differs between two optimizer state dicts, the first as the default export makes
    it (on any device), the second as the option does (on CPU, bit for bit): [text]."""
    import torch  # pylint: disable=import-outside-toplevel

    found = []
    if actual["param_groups"] != expected["param_groups"]:
        found.append("param_groups differ")
    if actual["state"].keys() != expected["state"].keys():
        return found + ["the parameters of the states differ"]
    for key, states in expected["state"].items():
        if actual["state"][key].keys() != states.keys():
            found.append(f"parameter {key}: the names of the states differ")
            continue
        for name, value in states.items():
            got = actual["state"][key][name]
            where = f"parameter {key}, {name}"
            if not isinstance(value, torch.Tensor):
                if got != value:
                    found.append(f"{where}: {got!r} != {value!r}")
            elif got.device.type != "cpu" or got.dtype != value.dtype or got.shape != value.shape:
                found.append(f"{where}: {got.dtype} {tuple(got.shape)} on {got.device}")
            elif not torch.equal(_bits(got), _bits(value.cpu())):
                found.append(f"{where}: other values")
    return found


def _bits(tensor):
    """The tensor's bits, so that NaN and -0.0 compare as bits do."""
    import torch  # pylint: disable=import-outside-toplevel

    if not tensor.is_floating_point():
        return tensor
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return tensor.contiguous().view(ints[tensor.element_size()])


def _export(torch, optimizer, offload):
    """(state dict on CPU, peak GPU bytes above the memory allocated before, seconds). The
    default export is followed by its copy to CPU, timed with it: both times are of the same
    work, the states from the optimizer to CPU."""
    optimizer.state_dict_cpu_offload = offload
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before, start = torch.cuda.memory_allocated(), time.perf_counter()
    state_dict = optimizer.state_dict()
    if not offload:
        state_dict = {
            "param_groups": state_dict["param_groups"],
            "state": {
                k: {name: v.cpu() if isinstance(v, torch.Tensor) else v for name, v in s.items()}
                for k, s in state_dict["state"].items()
            },
        }
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return state_dict, torch.cuda.max_memory_allocated() - before, seconds


def check(log2):
    """Run the check; (exit status, lines to print)."""
    try:
        import torch  # pylint: disable=import-outside-toplevel
    except ImportError as exc:
        return 4, [f"cannot run: PyTorch does not import in this Python ({exc})"]
    if not torch.cuda.is_available():
        return 4, [f"cannot run: no CUDA GPU is visible to this PyTorch ({torch.__version__})"]
    try:
        import transformer_engine  # pylint: disable=import-outside-toplevel
        import transformer_engine.pytorch as te  # pylint: disable=import-outside-toplevel
    except (ImportError, OSError) as exc:
        return 4, [f"cannot run: TransformerEngine does not import: {exc}"]
    lines = [
        f"TE {transformer_engine.__version__} ({transformer_engine.__path__[0]}), torch "
        f"{torch.__version__}, {torch.cuda.get_device_name()}"
    ]
    if "state_dict_cpu_offload" not in inspect.signature(te.optimizers.FusedAdam).parameters:
        return 1, lines + [
            "FAILED: this TE's FusedAdam has no state_dict_cpu_offload: the series is not "
            "applied to it (te-fusedadam-offload apply --installed)"
        ]
    n = 2**log2
    sizes = [n // 2, n // 4, n // 8, n - n // 2 - n // 4 - n // 8]
    torch.manual_seed(0)
    params = [
        torch.nn.Parameter(torch.randn(s, device="cuda", dtype=torch.bfloat16)) for s in sizes
    ]
    optimizer = te.optimizers.FusedAdam(
        params,
        lr=1e-3,
        master_weights=True,
        exp_avg_dtype=torch.bfloat16,
        exp_avg_sq_dtype=torch.bfloat16,
        state_dict_cpu_offload=True,
    )
    for _ in range(2):
        for param in params:
            param.grad = torch.randn_like(param)
        optimizer.step()
    for param in params:
        param.grad = None
    lines.append(
        f"2^{log2} BF16 parameter elements in {len(sizes)} tensors, FP32 master weights, BF16 "
        "moments, two steps"
    )
    default, default_peak, default_s = _export(torch, optimizer, False)
    lines.append(
        f"  default export, then .cpu(): GPU +{default_peak / MiB:.1f} MiB, {default_s:.2f} s"
    )
    torch.cuda.empty_cache()
    offloaded, peak, seconds = _export(torch, optimizer, True)
    lines.append(f"  state_dict_cpu_offload=True: GPU +{peak / MiB:.1f} MiB, {seconds:.2f} s")
    found = differences(default, offloaded)
    count = sum(len(s) for s in default["state"].values())
    if found:
        lines += [f"FAILED: not bitwise the default export: {d}" for d in found[:10]]
    else:
        lines.append(f"  the states: bitwise the default export's ({count} tensors, on CPU)")
    if peak > 0:
        lines.append(f"FAILED: the export with the option took {peak} bytes of GPU memory")
    if found or peak > 0:
        return 1, lines
    return 0, lines + ["ok: FusedAdam(state_dict_cpu_offload=True) works here"]


def main(argv=None):
    """python -m te_fusedadam_offload.gpu_check [--log2 N]"""
    parser = argparse.ArgumentParser(
        prog="python -m te_fusedadam_offload.gpu_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--log2", type=int, default=27, help="2^N parameter elements (27)")
    code, lines = check(parser.parse_args(argv).log2)
    print("\n".join(lines), file=sys.stderr if code == 4 else sys.stdout)
    return code


if __name__ == "__main__":
    sys.exit(main())
