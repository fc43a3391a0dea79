"""Every line of saving and resuming, in one room (the Ray runtime, the engine core and the
AReaL and verl doors call it):

- ``files``, ``folders``, ``claim``: tensors-only, checksummed, atomic files; a run's folders
  and its claim on them from its first second;
- ``checkpoint``: a run's folder prepared, the helpers of its checkpoints
  (``latest_checkpoint``, ``prune``, the RNG states and the optimizer's hyperparameters;
  ``step_name``, ``read_meta``, ``publish`` live in ``files``);
- ``whole``: one process's checkpoint of a whole state (a replica; ``save_checkpoint`` /
  ``load_checkpoint``: a plain model, the Python API);
- ``pieces``, ``logical``, ``optimizer_state``: the training state's layout-free view
  (per parameter by name and whole shape) as DCP's logical tensors;
- ``sharded``: the one format every layout writes -- DCP files of that view (every rank its
  pieces, or one process the whole), ``rng.pt``, ``meta.json``, ``manifest.json``;
- ``reshard``: any source into any layout; ``legacy``: the one reader of the formats DTA no
  longer writes, each named by what wrote it (a replica's ``model.pt`` / ``optimizer.pt``,
  DTA up to 2026-12-07; the sharded format of DTA 0.1.0 before 2026-12-05);
- ``engine``: the engine core's save / load with a front door's ``extra_state``;
- ``hf``: Hugging Face folders and per-rank optimizer files (AReaL's ``hf`` format)."""
