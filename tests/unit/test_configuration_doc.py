"""docs/configuration.md lists every setting of `Settings` once, with its default: the page and
the class cannot drift apart."""

import re
from dataclasses import MISSING, fields
from pathlib import Path

from structspec.config import Settings

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
ROW = re.compile(r"^\| `STRUCTSPEC_([A-Z0-9_]+)` \| ([^|]*) \|", re.M)
# Defaults the page describes rather than spells: derived when the settings are built
# (the two URLs, the ingest queue) or from the user's home directory.
DESCRIBED = {"database_url", "broker_url", "ingest_queue", "data_dir", "cache_dir"}


def rows() -> list[tuple[str, str]]:
    return [(name.lower(), default.strip()) for name, default in ROW.findall(DOC.read_text(encoding="utf-8"))]


def documented(cell: str) -> str:
    """The default as the page writes it: the first `code` span, or '' for '(empty)'."""
    if cell.startswith("(empty)"):
        return ""
    m = re.match(r"`([^`]*)`", cell)
    assert m, f"a default cell should start with `value` or (empty): {cell!r}"
    return m.group(1)


def same(value, written: str) -> bool:
    if isinstance(value, bool):
        return written.lower() in (("true", "1") if value else ("false", "0"))
    if isinstance(value, int):
        return re.fullmatch(r"-?\d+", written) is not None and int(written) == value
    return str(value) == written


def test_every_setting_is_documented_once_and_nothing_else():
    names = [name for name, _ in rows()]
    assert len(names) == len(set(names)), f"listed twice: {sorted(n for n in set(names) if names.count(n) > 1)}"
    known = {f.name for f in fields(Settings)}
    assert set(names) - known == set(), "the page lists settings that do not exist"
    assert known - set(names) == set(), "settings missing from docs/configuration.md"


def test_every_documented_default_is_the_class_default():
    defaults = {f.name: f.default for f in fields(Settings) if f.default is not MISSING}
    wrong = [(name, cell, defaults[name]) for name, cell in rows()
             if name in defaults and name not in DESCRIBED and not same(defaults[name], documented(cell))]
    assert wrong == []


def test_the_described_defaults_name_what_they_derive_from():
    cells = dict(rows())
    assert "$DATA_DIR" in cells["database_url"] and "$DATA_DIR" in cells["broker_url"]
    assert "STRUCTSPEC_DATA_DIR" in DOC.read_text(encoding="utf-8")
    # the derivations the page states are the ones Settings makes
    s = Settings(data_dir=Path("/d"))
    assert s.database_url == "sqlite:////d/structspec.db" and "/d/broker.db" in s.broker_url
    assert s.ingest_queue == f"{s.job_queue}-ingest"


def test_the_parser_reads_a_wrong_default_as_wrong():
    # the comparison itself can fail: a default written differently is caught
    assert not same(32, "16") and not same(True, "false") and not same("auto", "llguidance")
    assert same(True, "true") and same(0, "0") and same("", documented("(empty)"))
