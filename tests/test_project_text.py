"""The project's own text speaks of the project, not of how it was made: no work-log references
(numbered work periods or tracker items) in the README, the docs, the packages' sources, the configs and
the build files, no figure file named after a work period, and no reference to a design document under a
name it does not have (the design is ``docs/design.md``).

The files are the ones git knows (tracked, or new and not ignored) that exist in the working tree; without
git, the tree is walked. Each check lists every offender as ``path:line: text``.
"""
from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("heterog", "simulator", "envs", "agents", "experiments", "tests")
ROOT_FILES = ("README.md", "Makefile", "pyproject.toml")
SKIP_DIRS = {".git", ".venv", "__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache", ".hypothesis",
             "outputs", "multirun", "runs", "results", ".heterog-cache"}
TEXT_SUFFIXES = {".md", ".txt", ".py", ".yaml", ".yml", ".toml", ".json", ".csv", ".c", ".h", ".svg"}

# Written in pieces so that this file, which is scanned too, does not match its own patterns.
_NUMBER = "[0-9]+"
WORK_LOG = re.compile(
    r"\b" + "stop" + r"s? " + _NUMBER + r"\b"
    + r"|\b" + "issue" + r"s? #?" + _NUMBER + r"\b"
    + r"|\(" + "stop" + " " + _NUMBER + r"\)",
    re.IGNORECASE)
WORK_LOG_FILE_NAME = re.compile("stop" + "[0-9]", re.IGNORECASE)
DESIGN_DOC_MISNAMED = re.compile(r"\b" + "DESIGN" + r"\.md\b")     # case-sensitive: docs/design.md is fine


def _listed_files() -> list[str]:
    """Repository-relative paths git knows of (tracked, or untracked and not ignored) that exist on disk;
    the whole tree, less build and cache folders, when git is not available."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             cwd=ROOT, capture_output=True, check=True).stdout
        paths = sorted({p for p in out.decode("utf-8", "surrogateescape").split("\0") if p})
    except (OSError, subprocess.CalledProcessError):
        paths = []
        for folder, dirs, files in os.walk(ROOT):
            dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
            rel = Path(folder).relative_to(ROOT)
            paths.extend((rel / name).as_posix() for name in sorted(files))
    return [p for p in paths if (ROOT / p).is_file()]


def _in_scope(path: str) -> bool:
    """README, docs, the packages' Python sources, the experiment configs, Makefile and pyproject.toml."""
    parts = path.split("/")
    if path in ROOT_FILES or parts[0] == "docs":
        return True
    if parts[0] in SOURCE_DIRS and path.endswith(".py"):
        return True
    return path.startswith("experiments/conf/") and path.endswith((".yaml", ".yml"))


def project_files() -> list[str]:
    """Every file of the project's text the checks below cover (docs/ figures included, for their names)."""
    return [p for p in _listed_files() if _in_scope(p)]


def _is_text(path: str) -> bool:
    return Path(path).suffix in TEXT_SUFFIXES or Path(path).name in ROOT_FILES


def offending_lines(pattern: re.Pattern[str], paths: list[str]) -> Iterator[str]:
    """``path:line: text`` for every line of the text files in ``paths`` where ``pattern`` matches."""
    for path in paths:
        if not _is_text(path):
            continue
        text = (ROOT / path).read_text(encoding="utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), start=1):
            if pattern.search(line):
                yield f"{path}:{number}: {line.strip()}"


def test_project_files_are_found() -> None:
    paths = project_files()
    assert "README.md" in paths and "docs/results.md" in paths and "tests/test_project_text.py" in paths


def test_no_work_log_references_in_project_text() -> None:
    offenders = list(offending_lines(WORK_LOG, project_files()))
    assert not offenders, (f"{len(offenders)} work-log reference(s); say what was measured, with its commit "
                           "and date, instead:\n" + "\n".join(offenders))


def test_no_file_named_after_a_work_period() -> None:
    offenders = [p for p in project_files() if WORK_LOG_FILE_NAME.search(Path(p).name)]
    assert not offenders, ("file names that cite a work period; name them by what they show:\n"
                           + "\n".join(offenders))


def test_design_doc_is_cited_by_its_name() -> None:
    offenders = list(offending_lines(DESIGN_DOC_MISNAMED, project_files()))
    assert not offenders, ("references to a design document that does not exist (the design is "
                           "docs/design.md):\n" + "\n".join(offenders))


def test_patterns_catch_what_they_are_for() -> None:
    """The patterns on made-up lines (built here, so this file does not match itself)."""
    stop, issue = "stop", "issue"
    for line in (f"the {stop} 32 run", f"({stop} 12)", f"{stop.capitalize()}s 27-29", f"{issue} 21's target",
                 f"see {issue} #5"):
        assert WORK_LOG.search(line), line
    for line in (f"non-{stop} 3x faster", "the stops of a chain", f"{stop}-words", "issues of the tracker"):
        assert not WORK_LOG.search(line), line
    assert WORK_LOG_FILE_NAME.search(f"curves_{stop}28.png")
    assert not WORK_LOG_FILE_NAME.search("curves_2026-11-25.png")
    assert DESIGN_DOC_MISNAMED.search("see " + "DESIGN" + ".md, section 6")
    assert not DESIGN_DOC_MISNAMED.search("see docs/design.md")
