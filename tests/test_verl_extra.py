"""The optional verl extra is reported, never skipped silently: where CI (``CI=true``) or
``DTA_REQUIRE_VERL=1`` requires it, a missing verl fails here; where it is installed, the
installed verl is the one the engine was checked against and ``strategy: dta`` is registered.
Imports nothing from verl at module level (it runs everywhere)."""
import importlib.util
import json
import os

import pytest


def _required() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true") or \
        os.environ.get("DTA_REQUIRE_VERL") == "1"


def test_verl_extra_installed_where_required():
    if importlib.util.find_spec("verl") is None:
        if _required():
            pytest.fail("the verl extra is required here (CI / DTA_REQUIRE_VERL=1) but not "
                        "installed: run bash scripts/setup.sh --verl")
        pytest.skip("the optional verl extra is not installed: tests/test_verl*.py are skipped "
                    "(bash scripts/setup.sh --verl runs them)")
    import importlib.metadata as md
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from verl.workers.engine.base import EngineRegistry

        import runtime.verl  # noqa: F401
    assert md.version("verl") == "0.9.1", "runtime/verl was checked against verl 0.9.1"
    # `import verl` loads runtime.verl in every verl process (Ray workers too): its plugin
    plugins = {ep.name: ep.value for ep in md.entry_points(group="verl.plugins")}
    assert plugins.get("dta") == "runtime.verl", plugins
    registered = EngineRegistry._engines["language_model"]["dta"]
    assert set(registered) == {"cuda", "cpu"}
    assert registered["cpu"] is runtime.verl.DTAEngineWithLMHead


def test_import_verl_alone_registers_the_dta_engine():
    """What a verl worker process (a Ray actor) does: ``import verl`` and nothing of DTA; the
    plugin entry point registers strategy dta, and on a machine without an accelerator verl's
    platform is the cpu one (verl's own detection would fall back to nvidia)."""
    import subprocess
    import sys

    if importlib.util.find_spec("verl") is None:
        pytest.skip("the optional verl extra is not installed")
    code = ("import warnings; warnings.simplefilter('ignore'); import json, sys, verl, torch; "
            "from verl.workers.engine.base import EngineRegistry; "
            "from verl.utils.device import get_device_name; "
            "print(json.dumps([sorted(EngineRegistry._engines['language_model']['dta']), "
            "get_device_name(), torch.cuda.is_available(), 'runtime.verl' in sys.modules]))")
    env = {k: v for k, v in os.environ.items() if k != "VERL_PLATFORM"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    devices, device, cuda, loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert devices == ["cpu", "cuda"] and loaded  # runtime.verl imported by verl itself
    assert device == ("cuda" if cuda else "cpu")
