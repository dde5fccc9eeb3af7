"""A stager for ``torch.distributed.checkpoint.async_save`` that keeps its buffers from one
checkpoint to the next, and can take TE FusedAdam's optimizer states itself.

``dcp.async_save`` stages (copies) the whole state dict before it writes it. With
:class:`CheckpointStager` as its ``async_stager``, the copies go into pinned host buffers
that the stager allocates at the first checkpoint and reuses; CPU tensors are copied too,
except the private copies that the caller marks (:meth:`~CheckpointStager.private`,
:meth:`~CheckpointStager.optimizer_export`); :meth:`~CheckpointStager.optimizer_snapshot`
has it copy a TE ``FusedAdam``'s states itself, without the export's wait. The recipe is in
docs/checkpointing.rst, the reference in docs/staging.rst.

:meth:`~CheckpointStager.prepare` makes the buffers before the first checkpoint, in the
background; for a resume, :meth:`~CheckpointStager.load_template` gives them as the template of
``dcp.load`` and :class:`ParallelFileSystemReader` reads the checkpoint straight into them.

Modules: :mod:`.stager` (the ``AsyncStager``: protocol and lifecycle; nothing of TE),
:mod:`.buffers` (the buffers kept between checkpoints), :mod:`.walk` (what is copied, passed
through or refused), :mod:`.snapshot` (TE FusedAdam's snapshot), :mod:`.reader` (the reader
for ``dcp.load``), :mod:`.widening`.

This package is a runtime helper of this patch set, not TE code. It implements DCP's public
``AsyncStager`` protocol; of DTensor it uses the local tensor and the spec, as DCP's own
state-dict utilities and ``DTensor.to()`` do.
"""

try:
    import torch  # pylint: disable=unused-import
    from torch.distributed.checkpoint.staging import AsyncStager  # pylint: disable=unused-import
    from torch.distributed.tensor import DTensor  # pylint: disable=unused-import
except ImportError as exc:  # pragma: no cover (the message is tested in a torch-less process)
    raise ImportError(
        "te_fusedadam_offload.staging needs PyTorch with torch.distributed.checkpoint's "
        f"AsyncStager and DTensor ({exc}); install torch (the extra 'staging' of this package "
        "declares it: pip install '<its checkout>[staging]')"
    ) from exc

# pylint: disable=wrong-import-position
from .reader import ParallelFileSystemReader
from .snapshot import CheckpointStager

__all__ = ["CheckpointStager", "ParallelFileSystemReader"]
