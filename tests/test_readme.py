"""The README is a user's guide (issue 31): at most 220 lines, the two commands first (CI runs
exactly the second), every relative link in it and in docs/ resolves (anchors included), no
clock time of a trial or superseded reading in it, every headline figure dated, commanded and
found in docs/results.md, every `dta` command in it accepted by the CLI, and results/ holds
only what the docs cite."""
from __future__ import annotations

import importlib.util
import os
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
COMMANDS = ("bash scripts/setup.sh && .venv/bin/dta train",
            "bash scripts/setup.sh --areal --verl && .venv/bin/python -m pytest")
LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def markdown_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    h = re.sub(r"[`*_]", "", heading.strip().lower())
    return "".join(c for c in h if c.isalnum() or c in " -").replace(" ", "-")


def anchors(path: Path) -> set[str]:
    body = re.sub(r"```.*?```", "", text(path), flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+)$", body, re.M)}


def links(path: Path) -> list[str]:
    body = re.sub(r"```.*?```", "", text(path), flags=re.S)
    return [a or b for a, b in LINK.findall(body)]


def test_readme_is_at_most_220_lines():
    n = len(text(README).splitlines())
    assert n <= 220, f"README.md has {n} lines; the limit is 220 (move detail to docs/)"


def test_the_two_commands_come_first_and_ci_runs_the_second():
    lines = text(README).splitlines()
    block = lines[lines.index("```bash") + 1:lines.index("```")]
    assert [line.split("#")[0].strip() for line in block] == list(COMMANDS)
    assert lines.index("```bash") < 4  # right under the title
    ci = [line for line in text(ROOT / ".ci" / "run").splitlines()
          if line.strip() and not line.startswith("#")]
    assert ci[-1] == COMMANDS[1]


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: p.name)
def test_relative_links_resolve(path):
    bad = []
    for target in links(path):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked (no network)
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading with anchor #{anchor}")
    assert not bad, f"{path.relative_to(ROOT)}: " + "; ".join(bad)


def test_slug_follows_github():
    assert slug("## Full scale: the memory model's plan (2026-12-03)".lstrip("# ")) == \
        "full-scale-the-memory-models-plan-2026-12-03"
    assert slug("Exactness: the support matrix") == "exactness-the-support-matrix"


def test_readme_has_no_clock_time_or_superseded_reading():
    for k, line in enumerate(text(README).splitlines(), 1):
        assert not re.search(r"(?<![\d.:])([01]\d|2[0-3]):[0-5]\d(?![\d.])", line), \
            f"README.md:{k} carries a clock time: {line}"
        low = line.lower()
        for word in ("superseded", "before packs", "the old ", "re-measured", "earlier reading"):
            assert word not in low, f"README.md:{k} carries a superseded reading: {line}"


def headline_rows() -> list[list[str]]:
    lines = text(README).splitlines()
    start = lines.index("## Headline figures")
    rows = [line for line in lines[start:] if line.startswith("| ")]
    assert rows[0].startswith("| what | figure | date | command | result")
    return [[c.strip() for c in row.strip("|").split(" | ")] for row in rows[1:]]


def test_every_headline_figure_is_dated_commanded_linked_and_in_results_md():
    results = text(ROOT / "docs" / "results.md")
    rows = headline_rows()
    assert len(rows) >= 6
    for what, figure, date, command, link in rows:
        assert re.fullmatch(r"20\d\d-\d\d-\d\d", date), (what, date)
        assert command.startswith("`") or command.startswith("the same"), (what, command)
        assert re.search(r"\]\((results/|docs/results\.md)", link), (what, link)
        for bold in re.findall(r"\*\*(.+?)\*\*", figure):
            number = re.search(r"\d+(\.\d+)?×", bold).group(0)
            assert number in results, f"{what}: {number} is not in docs/results.md"
        folder = re.search(r"\((results/[^/)]+)/", link)
        if folder:
            assert folder.group(1) in results, f"{what}: docs/results.md does not cite {folder.group(1)}"


def readme_commands() -> list[str]:
    """Every `dta ...` / `python -m ...` command of the README's bash blocks and of its
    headline table."""
    body = text(README)
    cmds = []
    for block in re.findall(r"```bash\n(.*?)```", body, re.S):
        joined = block.replace("\\\n", " ")
        cmds += [line.split("  #")[0].strip() for line in joined.splitlines()]
    cmds += [row[3].strip("`") for row in headline_rows() if row[3].startswith("`")]
    return [c.removeprefix(".venv/bin/") for c in cmds
            if c.removeprefix(".venv/bin/").startswith(("dta ", "python -m "))]


def test_readme_commands_are_accepted():
    from dta.config.schema import load_config
    from dta_cli.main import build_parser

    cmds = readme_commands()
    assert any(c.startswith("dta bench") for c in cmds) and any(c.startswith("dta train") for c in cmds)
    for cmd in cmds:
        argv = shlex.split(cmd)
        if argv[0] == "python":
            module = argv[2]
            if module != "pytest":
                assert importlib.util.find_spec(module) is not None, cmd
            continue
        args = build_parser(argv[1]).parse_args(argv[1:])  # SystemExit on an unknown flag
        if argv[1] == "train":
            config = str(ROOT / args.config) if getattr(args, "config", None) else None
            load_config(config, list(args.overrides))  # unknown keys, bad values raise


def test_results_holds_only_what_the_docs_cite():
    cited = "\n".join(text(p) for p in markdown_files())
    cited += text(ROOT / "experiments" / "bench_path_memory.py")
    scratch = {"tmp"}  # results/tmp/: git-ignored scratch space (.gitignore)
    orphans = [e for e in sorted(os.listdir(ROOT / "results"))
               if not e.startswith(".") and e not in scratch and f"results/{e}" not in cited]
    assert not orphans, f"results/ entries no doc cites: {orphans}"


def test_the_library_example_runs_and_matches_the_reference():
    """The README's Python example, as printed, on a small batch with shared prefixes; its
    loss equals one-sequence-at-a-time training's."""
    import numpy as np
    import torch

    from dta.reference import unpacked_gradients
    from tests.cases import make_records

    (code,) = re.findall(r"```python\n(.*?)```", text(README), re.S)
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 500, 20)
    seqs = [np.concatenate([prompt, rng.integers(3, 500, n)]) for n in (5, 9, 3)]
    scope = {"records": make_records(seqs)}
    torch.manual_seed(0)
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 (the README's own code)
    result = scope["result"]
    assert result.updated and np.isfinite(result.loss)
    fresh: dict = {}  # the example's model again, before its step, from the same seed
    torch.manual_seed(0)
    exec(compile(code.split("batch =")[0], "README.md", "exec"), fresh)  # noqa: S102
    reference = unpacked_gradients(fresh["model"], scope["batch"], scope["trainer"].loss)
    assert abs(result.loss - reference.loss) <= 1e-5 * abs(reference.loss)
