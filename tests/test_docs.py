"""Docs that cannot rot: the code in README.md and docs/*.md runs, and the links between files resolve.

Rules (also for whoever writes docs):
- a fenced ```python block is executed, alone, in a fresh interpreter in an empty directory (CPU, no
  network, seconds); ```py blocks are shown, never run;
- a ```bash block is run when every command in it is cheap by `cheap_command` (`shadowprefill` or
  `python -m shadowprefill` with `--help` or `--version`, `gateway table`, a `simulate` on one instance per
  model of at most 60 simulated seconds; `python examples/X.py` on CPU); any other ```bash block is shown only, as are ```console blocks (servers,
  `make`, `pip`, `curl`); a run block directly followed by a ```text block must print exactly that text;
- every relative link `[..](path#anchor)` in every *.md file of the repository points to an existing file,
  and an #anchor to a heading of the target file (GitHub's anchor rule).
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP_DIRS = {"build", "dist", "node_modules", "demo_out", "out"}
# Written on other branches of the same wave; the coordinator deletes this list once they are merged.
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([\w+-]*)")


def fenced_blocks(path: Path) -> list[tuple[str, int, str]]:
    """(language, first line number, text) of every fenced block of a markdown file, in order."""
    blocks, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(1), m.group(2).lower(), i + 1
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            i += 1
        blocks.append((lang, start, "\n".join(lines[start:i])))
        i += 1
    return blocks


def all_markdown() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.md")
                  if not any(part.startswith(".") or part in SKIP_DIRS for part in p.relative_to(ROOT).parts))


# ---- python blocks --------------------------------------------------------------------------------------
PYTHON_BLOCKS = [pytest.param(text, id=f"{p.relative_to(ROOT)}:{line}")
                 for p in RUN_DOCS for lang, line, text in fenced_blocks(p) if lang == "python"]


@pytest.mark.parametrize("code", PYTHON_BLOCKS)
def test_python_block_runs(code, tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]


# ---- bash blocks ----------------------------------------------------------------------------------------
def commands(text: str) -> list[str]:
    """The commands of a shell block: continuation lines joined, comments and blank lines dropped."""
    out, current = [], ""
    for line in text.splitlines():
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        if current.strip() and not current.strip().startswith("#"):
            out.append(current.strip())
        current = ""
    return out


def _option(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv and argv.index(name) + 1 < len(argv) else None


def cheap_command(command: str) -> list[str] | None:
    """The argv to run for a cheap documented command, or None (shown only)."""
    if any(c in command for c in "|;&<>$`"):
        return None
    argv = shlex.split(command, comments=True)
    if argv[:1] == ["python"] and len(argv) == 2 and re.fullmatch(r"examples/\w+\.py", argv[1]):
        return [sys.executable, str(ROOT / argv[1])]
    if argv[:3] == ["python", "-m", "shadowprefill"]:
        argv = ["shadowprefill", *argv[3:]]
    if argv[:1] != ["shadowprefill"]:
        return None
    args = argv[1:]
    run = [sys.executable, "-m", "shadowprefill", *args]
    if "--help" in args or "-h" in args or args == ["--version"] or args[:2] == ["gateway", "table"]:
        return run
    if args[:1] == ["simulate"] and _option(args, "--instances") == "1":
        duration = _option(args, "--duration")
        if duration is not None and float(duration) <= 60:
            return run
    return None


def bash_blocks() -> list:
    params = []
    for path in RUN_DOCS:
        blocks = fenced_blocks(path)
        for k, (lang, line, text) in enumerate(blocks):
            if lang not in ("bash", "sh", "shell"):
                continue
            argvs = [cheap_command(c) for c in commands(text)]
            if not argvs or None in argvs:
                continue                                      # shown only
            following = blocks[k + 1] if k + 1 < len(blocks) else None
            expected = None
            if following and following[0] == "text" and following[1] - (line + text.count("\n") + 1) <= 2:
                expected = following[2]
            params.append(pytest.param(argvs, expected, id=f"{path.relative_to(ROOT)}:{line}"))
    return params


@pytest.mark.parametrize("argvs, expected", bash_blocks())
def test_cheap_bash_block_runs(argvs, expected, tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    stdout = ""
    for argv in argvs:
        done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (argv, done.stderr[-4000:])
        stdout += done.stdout
    if expected is not None:
        got = [line.rstrip() for line in stdout.strip().splitlines()]
        assert got == [line.rstrip() for line in expected.strip().splitlines()], \
            "the documented output changed; the command now prints:\n" + stdout


def test_the_block_rules_are_applied():
    """The rules select what they say: the README's quick starts run, servers and set-up do not."""
    assert cheap_command("shadowprefill simulate --help")
    assert cheap_command("shadowprefill --version") == cheap_command("python -m shadowprefill --version")
    assert cheap_command("shadowprefill simulate --pair A/B --instances 1 --duration 60 --out x.json")
    assert not cheap_command("shadowprefill simulate --pair A/B --duration 600 --out x.json")
    assert not cheap_command("shadowprefill serve-manager --config m.json")
    assert not cheap_command("make demo")
    assert not cheap_command("shadowprefill --help | head")
    assert [c.split() for c in commands("a \\\n  b\n# comment\n\nc")] == [["a", "b"], ["c"]]
    readme = [lang for lang, _, _ in fenced_blocks(ROOT / "README.md")]
    assert "python" in readme and "bash" in readme
    assert PYTHON_BLOCKS and any(p.values[1] is not None for p in bash_blocks())   # an output is checked


# ---- links ----------------------------------------------------------------------------------------------
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a markdown file (lower case, punctuation dropped, spaces to '-')."""
    seen: dict[str, int] = {}
    out = set()
    in_fence = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        m = re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if in_fence or not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every markdown link outside code blocks and inline code."""
    out, in_fence = [], False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        for m in LINK.finditer(re.sub(r"`[^`]*`", "", line)):
            out.append((number, m.group(1)))
    return out


@pytest.mark.parametrize("path", all_markdown(), ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(path):
    bad = []
    for line, target in links(path):
        if re.match(r"^[a-z]+:", target):                  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        rel = dest.relative_to(ROOT).as_posix() if dest.is_relative_to(ROOT) else str(dest)
        if not dest.exists():
            bad.append(f"{path.name}:{line}: {target}: no such file")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{path.name}:{line}: {target}: no heading with anchor #{anchor} in {rel}")
    assert not bad, "\n".join(bad)


def test_the_readme_keeps_its_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()
