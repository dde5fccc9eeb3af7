"""The process group and the checkpoint directory of the stager's GPU tests."""

import os
import tempfile

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def process_group():
    """The torchrun group, or a one-process group of this pytest."""
    if not torch.cuda.is_available():
        yield
        return
    import torch.distributed as dist

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
    import torch.distributed as dist

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
