"""What the READMEs point a user to exists: each relative link's file and heading, each test
cited by path (and by name after ``::``), and each option a ``torch-kv-tier`` command line in
them passes, spelled as the subcommand spells it."""

from __future__ import annotations

import argparse
import importlib
import re
from pathlib import Path

import pytest

from torch_kv_tier import cli

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "benchmarks/README.md")
VLLM_TESTS = "tests/v1/"  # vLLM's own suite, which CI fetches (.ci/vllm_transport_suite.sh)


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives ``heading``: its text lowercased, code and link marks dropped,
    every character but a letter, digit, ``-`` or ``_`` dropped, spaces made ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower()).replace("`", "")
    return "".join("-" if c == " " else c for c in text if c.isalnum() or c in " -_")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of markdown file ``path`` (a repeated one suffixed ``-1``, ...)."""
    counts: dict[str, int] = {}
    found = set()
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*$", text, re.M):
        anchor = github_anchor(heading)
        found.add(f"{anchor}-{counts[anchor]}" if anchor in counts else anchor)
        counts[anchor] = counts.get(anchor, 0) + 1
    return found


def broken_links(doc: Path) -> list[str]:
    """The relative links of ``doc`` whose file, or whose heading in a markdown file, is
    missing."""
    broken = []
    for link in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        if re.match(r"[a-z]+:", link):  # https:, mailto:
            continue
        name, _, anchor = link.partition("#")
        target = (doc.parent / name) if name else doc
        if not target.exists():
            broken.append(f"{link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{link}: {target.name} has no such heading")
    return broken


def missing_tests(doc: Path) -> list[str]:
    """The ``tests*/...py`` paths ``doc`` cites that do not exist, and the ``path::name`` whose
    test is not defined there."""
    missing = []
    cited = re.findall(r"\b(tests\w*/[\w/]+\.py)(?:::(\w+))?", doc.read_text())
    for path, name in sorted(set(cited)):
        if path.startswith(VLLM_TESTS):
            continue
        file = ROOT / path
        if not file.exists():
            missing.append(path)
        elif name and not re.search(rf"^def {name}\(", file.read_text(), re.M):
            missing.append(f"{path}::{name}")
    return missing


def command_lines(text: str) -> list[str]:
    """Each ``torch-kv-tier SUBCOMMAND ...`` of ``text``'s code (blocks, continuation lines
    joined, comments dropped; and inline code)."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
    inline = re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    code = [
        re.sub(r"\s#.*", "", line) for b in blocks for line in b.replace("\\\n", " ").splitlines()
    ]
    return [
        m for chunk in code + inline for m in re.findall(r"torch-kv-tier [a-z-]+[^;&|`]*", chunk)
    ]


def unknown_options(doc: Path) -> list[str]:
    """The ``--options`` of ``doc``'s command lines that their subcommand does not take."""
    unknown = []
    for line in command_lines(doc.read_text()):
        command = line.split()[1]
        if command not in cli._COMMANDS:
            unknown.append(f"{line}: no subcommand {command!r}")
            continue
        parser = argparse.ArgumentParser()
        importlib.import_module(cli._COMMANDS[command][0]).add_arguments(parser)
        taken = set(parser._option_string_actions)
        unknown += [f"{line}: {o}" for o in re.findall(r"--[\w-]+", line) if o not in taken]
    return unknown


@pytest.mark.parametrize("doc", DOCS)
def test_every_link_reaches_a_file_and_heading_that_exist(doc: str) -> None:
    assert broken_links(ROOT / doc) == []


@pytest.mark.parametrize("doc", DOCS)
def test_every_test_cited_exists(doc: str) -> None:
    assert missing_tests(ROOT / doc) == []


@pytest.mark.parametrize("doc", DOCS)
def test_every_option_of_a_command_line_is_one_its_subcommand_takes(doc: str) -> None:
    assert unknown_options(ROOT / doc) == []
