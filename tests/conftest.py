import os

import pytest
import torch

# Tiny models: one thread is faster than two fighting over a 2-core CI machine.
torch.set_num_threads(int(os.environ.get("DTA_TEST_THREADS", "1")))


@pytest.fixture(scope="module")
def one_thread():
    """One thread for a module's tests, whatever an earlier module left set."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
