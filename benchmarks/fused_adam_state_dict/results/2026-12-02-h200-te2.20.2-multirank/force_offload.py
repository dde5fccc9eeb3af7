"""FORCED_SITE of the multirank harness: every FusedAdam made with state_dict_cpu_offload=True
unless the caller says otherwise, so that TE's own tests run the option's export."""

import functools

import transformer_engine.pytorch as te

_init = te.optimizers.FusedAdam.__init__


@functools.wraps(_init)
def _forced(self, *args, **kwargs):
    kwargs.setdefault("state_dict_cpu_offload", True)
    _init(self, *args, **kwargs)


te.optimizers.FusedAdam.__init__ = _forced
