"""Examples of AReaL's RL loop with DTA (``python -m runtime.areal.examples.tau2_grpo``)."""
