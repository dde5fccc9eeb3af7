"""FusedAdam.set_scaled_state() of BF16 moments from FP32 CPU values, with the TE on PYTHONPATH.

  PYTHONPATH=<TE with PR 3> python3 set_states.py; PYTHONPATH=<TE without it> python3 set_states.py

FusedAdam with BF16 exp_avg and exp_avg_sq over 32 FP32 parameters of 2^24 elements (the
moments of 2^29 elements); their FP32 values (randn, one tensor per state) in pinned and in
pageable memory; every state set from them, twice each. One JSON line: seconds per way, and
whether every way gave the states of the first, bitwise.
"""

import json
import time

import torch
import transformer_engine
from transformer_engine.pytorch.optimizers import FusedAdam

LAYERS, ELEMENTS = 32, 1 << 24


def main():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(ELEMENTS, device="cuda")) for _ in range(LAYERS)]
    optimizer = FusedAdam(params, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    for param in params:
        optimizer.initialize_state(param, False)
    names = ("exp_avg", "exp_avg_sq")
    values = [torch.randn(ELEMENTS) for _ in range(LAYERS * len(names))]
    row, first = {"te": transformer_engine.__file__.rsplit("/", 2)[0]}, None  # its site dir
    bitwise = True
    for memory in ("pinned", "pageable"):
        sources = [v.pin_memory() for v in values] if memory == "pinned" else values
        seconds = []
        for _ in range(2):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for i, param in enumerate(params):
                for j, name in enumerate(names):
                    optimizer.set_scaled_state(param, name, sources[i * len(names) + j])
            torch.cuda.synchronize()
            seconds.append(round(time.perf_counter() - start, 3))
            states = [optimizer.state[p][n].clone() for p in params for n in names]
            first = states if first is None else first
            bitwise &= all(torch.equal(a, b) for a, b in zip(states, first))
            for p in params:
                for n in names:
                    optimizer.state[p][n].zero_()
        row[f"{memory}_s"] = seconds
    row["bitwise"] = bitwise
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
