"""CPU checks of te_fusedadam_offload.staging.CheckpointStager (the GPU tests, with TE, FSDP2
and DCP on disk, are in tests/staging/)."""

import pytest

torch = pytest.importorskip("torch")

from te_fusedadam_offload.staging import CheckpointStager  # pylint: disable=wrong-import-position


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
