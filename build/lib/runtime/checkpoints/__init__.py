"""Checkpoint storage shared by the Ray runtime, DCP, resharding and the AReaL adapter:
tensors-only, checksummed, atomic files (``files``), a run's folders (``folders``), a run's
claim on its folder from its first second (``claim``) and the trainer checkpoint format
(``checkpoint``)."""
