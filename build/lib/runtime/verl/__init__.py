"""DTA as a verl training engine: ``strategy: dta`` (see docs/verl.md).

Importing this package registers :class:`~runtime.verl.engine.DTAEngineWithLMHead` in verl's
``EngineRegistry`` (``language_model`` / ``dta`` / cuda and cpu) and the ``cpu`` platform
(:mod:`runtime.verl.platform`). Needs the optional ``verl`` extra (``scripts/setup.sh --verl``).
"""
# the cpu platform first: verl resolves VERL_PLATFORM=cpu at its first device query, which
# importing its engine modules makes
from runtime.verl.platform import PlatformCPU, use_cpu_platform  # noqa: I001
from runtime.verl.config import DTAEngineConfig
from runtime.verl.engine import DTAEngine, DTAEngineWithLMHead

__all__ = ["DTAEngine", "DTAEngineWithLMHead", "DTAEngineConfig", "PlatformCPU",
           "use_cpu_platform"]
