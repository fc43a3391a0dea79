"""Training records: their fields and checks (``fields``) and the JSONL format (``jsonl``)."""
