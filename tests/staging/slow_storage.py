"""A slow storage for DCP: a FileSystemWriter whose uploads wait before they write, as a busy
or remote file system makes them take longer than the training between checkpoints. Used by
the stager's GPU tests (tests/staging), its CPU checks (tests/tool/test_staging.py) and the
stall benchmark (--write-delay-s)."""

import time

from torch.distributed.checkpoint import FileSystemWriter


class SlowWriter(FileSystemWriter):
    """FileSystemWriter(path) whose write_data() waits `delay_s` seconds before it reads the
    staged tensors, in the upload's thread; `started` is set when it begins waiting."""

    def __init__(self, path, delay_s, **kwargs):
        super().__init__(path, **kwargs)
        self.delay_s = delay_s
        self.started = None

    def write_data(self, plan, planner):
        self.started = time.monotonic()
        time.sleep(self.delay_s)
        return super().write_data(plan, planner)
