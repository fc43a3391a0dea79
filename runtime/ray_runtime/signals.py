"""The driver's signal handlers kept past ``ray.init`` (``dta train``'s stop: run.py)."""
from __future__ import annotations

import contextlib
import signal
import threading


@contextlib.contextmanager
def keep_signal_handlers():
    """The driver's own SIGTERM/SIGINT handlers (a Python function: ``dta train``'s stop)
    again after ``ray.init``, which installs Ray's -- a Python SIGTERM handler that exits,
    and the core worker's native one that prints a stack dump and aborts. Python's
    ``signal.signal`` puts its own C handler back in place of the native one."""
    main = threading.current_thread() is threading.main_thread()
    kept = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)} \
        if main else {}
    try:
        yield
    finally:
        for sig, handler in kept.items():
            if callable(handler) and handler is not signal.default_int_handler:
                signal.signal(sig, handler)
