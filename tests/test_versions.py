"""The tested dependency set (constraints.txt, pyproject's ranges) and the run-time warning
outside it (dta.versions; docs/versions.md)."""
from __future__ import annotations

import json
import re
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from dta import versions
from dta_cli.main import main

ROOT = Path(__file__).resolve().parent.parent


def _lock() -> dict[str, str]:
    pins = {}
    for n, line in enumerate((ROOT / "constraints.txt").read_text().splitlines(), 1):
        line = line.split("#")[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([^\s;]+)", line)
        if m is None:
            raise AssertionError(f"constraints.txt:{n}: not a 'name==version' pin: {line!r}")
        pins[m.group(1).lower().replace("_", "-")] = m.group(2)
    return pins


def _pyproject_requirements() -> list[Requirement]:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        lines += extra
    return [Requirement(x) for x in lines]


def test_installed_packages_are_the_locked_set():
    """What scripts/setup.sh installed is constraints.txt, version for version (torch's local
    +cpu label aside); torch and transformers are among the pins."""
    pins = _lock()
    assert {"torch", "transformers", "ray", "peft", "omegaconf"} <= set(pins)
    differ = []
    for name, want in pins.items():
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue  # an optional stack this venv was set up without (e.g. no --verl)
        if Version(have).public != Version(want).public:
            differ.append(f"{name}: installed {have}, locked {want}")
    assert not differ, differ
    assert Version(metadata.version("transformers")) == Version(pins["transformers"])


def test_pyproject_ranges_hold_the_lock():
    """Every dependency range has an upper bound, and the locked (tested) version is inside
    it; torch's and transformers' ranges are a floor and a ceiling (``>=A,<=B``) around the
    lock, the floor reaching the hosts' (AReaL 1.0.4 asks torch >=2.9.1, transformers >=5.0.0;
    docs/versions.md)."""
    pins = _lock()
    for req in _pyproject_requirements():
        uppers = [s for s in req.specifier if s.operator in ("<=", "<", "==")]
        assert uppers, f"pyproject.toml: {req} has no upper bound"
        if req.name in pins:
            assert req.specifier.contains(pins[req.name], prereleases=True), (req, pins[req.name])
    for name, host_floor in (("torch", "2.9.1"), ("transformers", "5.0.0")):
        req = next(r for r in _pyproject_requirements() if r.name == name)
        assert sorted(s.operator for s in req.specifier) == ["<=", ">="], req
        floor = next(Version(s.version) for s in req.specifier if s.operator == ">=")
        assert floor <= Version(host_floor), req


def test_the_installed_metadata_states_pyprojects_range():
    """dta.versions reads the range from the installed package: the same as pyproject.toml
    (a stale editable install would warn against an old range)."""
    req = next(r for r in _pyproject_requirements() if r.name == "transformers")
    assert versions.tested_range("transformers") == str(req.specifier)
    assert versions.untested() == []  # this venv is the tested set


def test_outside_the_range_dta_warns_in_one_line_and_still_verifies(monkeypatch, capsys):
    real = versions.installed
    monkeypatch.setattr(versions, "installed",
                        lambda name: "5.99.0" if name == "transformers" else real(name))
    code = main(["verify", "--family", "llama", "--dtype", "float64", "--max-sequences", "3",
                 "--json"])
    out, err = capsys.readouterr()
    warned = [ln for ln in err.splitlines() if "warning" in ln]
    assert len(warned) == 1, err
    assert "transformers 5.99.0 is outside the range DTA was tested with" in warned[0]
    assert versions.tested_range("transformers") in warned[0]
    assert code == 0 and json.loads(out.strip().splitlines()[-1])["passed"] is True


def test_a_self_check_refusal_names_the_transformers_version(monkeypatch):
    """A probe the walker cannot even run through the model (what transformers 5.25 did to
    the hybrids' cache before dta/model/hf_cache.py) is a refusal naming the versions."""
    from dta.model.modeling import ModelInterface, ModelInterfaceError
    from dta.model.models import build_model
    from dta.selfcheck import SelfCheckError, self_check

    def broken(self, ids, start, path):
        raise ModelInterfaceError(f"{self.name}: the path's cache holds 0 positions, the node "
                                  f"starts at {start}")

    monkeypatch.setattr(ModelInterface, "forward", broken)
    model = build_model("llama", "tiny", dtype="float32", seed=0)
    with pytest.raises(SelfCheckError) as err:
        self_check(model, raise_on_failure=True)
    msg = str(err.value)
    assert f"transformers {metadata.version('transformers')}" in msg and "0 positions" in msg
    assert "\n" not in msg


def test_a_family_the_installed_transformers_lacks_is_refused_in_one_line(monkeypatch):
    """The hybrid families need what transformers 5.14 brings (a Gated DeltaNet forward that
    continues a multi-token chunk from the per-state cache layer the walk forks; 5.0 - 5.4 do
    not even have the layer): on older releases they are refused, naming that release; the
    others build."""
    import transformers

    from dta.model.families import FAMILIES, refusal
    from dta.model.models import build_model

    monkeypatch.setattr(transformers, "__version__", "5.3.0")
    with pytest.raises(ValueError) as err:
        build_model("qwen3_5", "tiny", dtype="float32")
    msg = str(err.value)
    assert "'qwen3_5' needs transformers >= 5.14.0" in msg and "transformers 5.3.0" in msg, msg
    assert "\n" not in msg
    assert refusal("qwen3_next", "5.13.1") and refusal("qwen3_next", "5.14.0") is None
    assert [f for f in FAMILIES if refusal(f, "5.0.0")] == ["qwen3_5", "qwen3_5_moe", "qwen3_next"]
    build_model("llama", "tiny", dtype="float32")


def test_the_float64_harness_keeps_integer_positions_in_float64():
    """transformers before 5.19 take RoPE as ``inv_freq.float() @ position_ids.float()``; inside
    the float64 harness the product of float64 frequencies with the (exact) float32 positions is
    taken in float64, a float32 ``inv_freq`` (a host re-initializing the buffer: verl's FSDP
    engine) stays float32 @ float32 instead of raising, and float64 tensors stay float64."""
    import torch

    from dta.model.models import keep_float64

    inv64 = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8))
    inv32 = inv64.float()
    with keep_float64():
        pos = torch.arange(4)[None, None].float()
        x = torch.ones(2, dtype=torch.float64).float()
        freqs64 = inv64[None, :, None].float() @ pos
        freqs32 = inv32[None, :, None].float() @ pos
    assert x.dtype == torch.float64 and freqs64.dtype == torch.float64
    assert torch.equal(freqs64, inv64[None, :, None] @ torch.arange(4.0, dtype=torch.float64)[None, None])
    assert freqs32.dtype == torch.float32
    assert torch.arange(4).float().dtype == torch.float32  # outside the harness: untouched


def test_a_bool_given_to_a_field_annotated_int_goes_in_as_that_int():
    """transformers 5.4.0 annotates OLMoE's and OLMo2's ``tie_word_embeddings: int`` and its
    strict config dataclasses refuse ``False`` there; build_config passes it as 0 (same truth),
    and leaves a field annotated bool, and every other value, as given."""
    import dataclasses

    from dta.model.models import as_annotated

    @dataclasses.dataclass
    class Config54:
        tie_word_embeddings: int = False
        use_cache: bool = True
        hidden_size: int = 32

    out = as_annotated(Config54, {"tie_word_embeddings": False, "use_cache": False,
                                  "hidden_size": 64, "rope_theta": 1e4})
    assert out == {"tie_word_embeddings": 0, "use_cache": False, "hidden_size": 64,
                   "rope_theta": 1e4}
    assert type(out["tie_word_embeddings"]) is int and type(out["use_cache"]) is bool
    assert as_annotated(dict, {"tie_word_embeddings": True}) == {"tie_word_embeddings": True}
