"""docs/repository.md against the tree: every module of the package's folders is named in its
folder's paragraph, and every folder and file the page names exists. A module added, moved or
renamed without the page fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "repository.md"
# the folders whose modules the page lists, each under its own heading line ("harness/", "rank/")
FOLDERS = ("reference", "scenarios", "harness", "harness/rank", "harness/rank/life", "harness/rank/checks",
           "harness/rank/plumbing", "harness/controller", "harness/controller/worlds", "harness/controller/commands",
           "harness/controller/reports", "targets", "shardcheck")


def _sections() -> dict[str, str]:
    """Folder (as in FOLDERS) -> the page's text from its heading line to the next heading of
    the same or a shallower indent."""
    lines = PAGE.read_text().splitlines()
    heads = []
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)([a-z_]+)/\s", line + " ")
        if m:
            heads.append((i, len(m.group(1)), m.group(2)))
    out, parents = {}, []
    for k, (i, indent, name) in enumerate(heads):
        parents = [(d, n) for d, n in parents if d < indent] + [(indent, name)]
        end = next((j for j, d, _ in heads[k + 1:] if d <= indent), len(lines))
        out["/".join(n for _, n in parents)] = "\n".join(lines[i:end])
    return out


def _modules(folder: str) -> list[str]:
    return sorted(p.stem for p in (ROOT / folder).glob("*.py") if p.stem != "__init__" and p.stem != "__main__")


def test_every_module_is_named_in_its_folders_paragraph():
    sections = _sections()
    missing = []
    for folder in FOLDERS:
        assert folder in sections, f"docs/repository.md has no paragraph for {folder}/"
        words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", sections[folder]))
        missing += [f"{folder}/{m}.py" for m in _modules(folder) if m not in words]
    assert not missing, "not named in docs/repository.md: " + ", ".join(missing)


def test_every_path_the_page_names_exists():
    text = PAGE.read_text()
    named = set(re.findall(r"\b([a-z_]+(?:/[a-z_]+)*\.(?:py|toml|md|sh|json))\b", text))
    sections = _sections()
    gone = []
    for path in sorted(named):
        where = [f for f in ["", *sections] if (ROOT / f / path).exists()]
        if not where and not any((ROOT / d).rglob(path) for d in ("harness", "targets", "tests", "ci", "docs")):
            gone.append(path)
    assert not gone, "docs/repository.md names what the tree does not have: " + ", ".join(gone)
    for folder in sections:
        assert (ROOT / folder).is_dir(), folder


def test_the_check_sees_a_module_the_page_does_not_name(tmp_path):
    global PAGE
    real, PAGE = PAGE, tmp_path / "repository.md"
    PAGE.write_text(real.read_text().replace("contract", "kontrakt"))
    try:
        test_every_module_is_named_in_its_folders_paragraph()
    except AssertionError as exc:
        assert "targets/contract.py" in str(exc)
    else:
        raise AssertionError("a module missing from the page went unseen")
    finally:
        PAGE = real
