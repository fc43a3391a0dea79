"""Every line of saving and resuming, in one room (the Ray runtime, the engine core and the
AReaL and verl doors call it):

- ``files``, ``folders``, ``claim``: tensors-only, checksummed, atomic files; a run's folders
  and its claim on them from its first second;
- ``checkpoint``: the replicated format (``model.pt`` / ``optimizer.pt`` / ``rng.pt``), the
  helpers every format shares (``step_name``, ``read_meta``, ``latest_checkpoint``,
  ``publish``, ``prune``), a run's folder prepared;
- ``pieces``, ``logical``, ``optimizer_state``: the training state's layout-free view
  (per parameter by name and whole shape) as DCP's logical tensors;
- ``sharded``: DCP checkpoints of that view (every rank its pieces);
- ``reshard``: any source into any layout; ``legacy``: the one reader of the sharded format
  DTA 0.1.0 wrote before 2026-12-05;
- ``engine``: the engine core's save / load with a front door's ``extra_state``;
- ``hf``: Hugging Face folders and per-rank optimizer files (AReaL's ``hf`` format)."""
