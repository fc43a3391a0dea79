"""Checkpoint storage shared by the Ray runtime, DCP, resharding and the AReaL adapter:
tensors-only, checksummed, atomic files (``files``), a run's folders (``folders``) and the
trainer checkpoint format (``checkpoint``)."""
