import os

import torch

# Tiny models: one thread is faster than two fighting over a 2-core CI machine.
torch.set_num_threads(int(os.environ.get("DTA_TEST_THREADS", "1")))
