"""The widening of low-precision values to FP32 in place, in the buffer that holds them."""

import torch

__all__ = ["widen"]


def widen(buffer, dtype):
    """Convert in place the `dtype` values copied into the end of the FP32 `buffer` into the
    FP32 values of all of it, front to back: each pass writes only bytes before the first
    value not yet read, and reads none that it writes, so a pass is one copy (parallel in
    PyTorch's intra-op threads)."""
    flat = buffer.view(-1)
    n, size = flat.numel(), flat.element_size()
    width = torch.empty((), dtype=dtype).element_size()
    assert width < size, (dtype, buffer.dtype)
    raw = flat.view(torch.uint8)[(size - width) * n :].view(dtype)
    done = 0
    while n - done > 2**16:
        end = ((size - width) * n + width * done) // size
        flat[done:end].copy_(raw[done:end])
        done = end
    flat[done:].copy_(raw[done:].clone())  # the last values overlap what they become
