"""The documentation stays true to the repository: links resolve, and the commands it shows exist.

- Every relative link in README.md, docs/*.md, benchmarks/RESULTS.md and benchmarks/journal/*.md names a file or
  folder of the repository; a link with `#anchor` into a markdown file names one of its headings (GitHub's slug:
  lowercase, spaces to hyphens, punctuation other than hyphens and underscores dropped, repeats numbered). Links into
  benchmarks/RESULTS.md are checked by a test of their own, so that a RESULTS page being rewritten shows as that.
- Every `esftctl ...` command that README.md or a guide shows (in a shell code block, or as inline code) names a
  command that exists, and every option it uses is in that command's `--help` (run in-process through typer's
  CliRunner, once per command); every `bash X`, `python X` and `python -m esftctl.X` names a script or module that
  exists, and `python -m pytest` the test files it names.
- README.md is one screen to a first success: at most 200 lines, an example request within the first 100; neither it
  nor a guide mentions internal issue numbers or working sessions.
"""

from __future__ import annotations

import functools
import re
import shlex
from pathlib import Path
from urllib.parse import unquote

import pytest

pytestmark = pytest.mark.quick  # about a second: part of `bash tests/run.sh -m quick`

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "RESULTS.md"


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def doc_files() -> list[Path]:
    """README.md and the guides: what users read, whose commands must run."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def link_files() -> list[Path]:
    journal = sorted((ROOT / "benchmarks" / "journal").glob("*.md"))
    return [*doc_files(), *([RESULTS] if RESULTS.exists() else []), *journal]


# ---------------------------------------------------------------------------------------------------------------
# Markdown, read just enough: fenced code blocks apart from prose, headings, links.

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([\w+-]*)")


def split_fences(text: str) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """The prose lines (code blocks blanked, so line numbers stay) and the code blocks as (language, lines)."""
    prose, blocks = [], []
    fence, lang, body = None, "", []
    for line in text.splitlines():
        m = FENCE.match(line)
        if fence is None and m:
            fence, lang, body = m.group(1), m.group(2).lower(), []
            prose.append("")
        elif fence is not None and line.strip().startswith(fence[0] * len(fence)) and not line.strip().strip(fence[0]):
            blocks.append((lang, body))
            fence = None
            prose.append("")
        elif fence is not None:
            body.append(line)
            prose.append("")
        else:
            prose.append(line)
    return prose, blocks


INLINE_CODE = re.compile(r"(`+)(.+?)\1")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.I)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text, lowercased, spaces to hyphens, and every character but
    letters, digits, hyphens and underscores dropped."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = INLINE_CODE.sub(lambda m: m.group(2), text)
    text = re.sub(r"<[^>]+>", "", text)  # HTML tags
    text = re.sub(r"(\*+|(?<!\w)_+|_+(?!\w))", "", text)  # emphasis markers (not underscores inside words)
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@functools.cache
def anchors(path: Path) -> frozenset[str]:
    prose, _ = split_fences(path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    found = set()
    for line in prose:
        found.update(HTML_ANCHOR.findall(line))
        m = HEADING.match(line)
        if not m:
            continue
        s = slug(m.group(2))
        n = seen.get(s, 0)
        seen[s] = n + 1
        found.add(s if n == 0 else f"{s}-{n}")
    return frozenset(found)


LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+[\"'][^\"']*[\"'])?\s*\)")
REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")
HREF = re.compile(r"<a\s[^>]*href=\"([^\"]+)\"", re.I)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every link in the file's prose: inline, reference definitions, and HTML hrefs."""
    prose, _ = split_fences(path.read_text(encoding="utf-8"))
    out = []
    for number, line in enumerate(prose, 1):
        line = INLINE_CODE.sub("", line)
        for pattern in (LINK, REF_DEF, HREF):
            out += [(number, target) for target in pattern.findall(line)]
    return out


def relative_links(path: Path) -> list[tuple[int, str, Path, str]]:
    """(line, link, the file it names, anchor) of every link that is not to another site."""
    out = []
    for number, target in links(path):
        if not target or SCHEME.match(target) or target.startswith("//"):
            continue
        where, _, anchor = target.partition("#")
        where = unquote(where)
        if not where:
            resolved = path
        elif where.startswith("/"):
            resolved = (ROOT / where.lstrip("/")).resolve()
        else:
            resolved = (path.parent / where).resolve()
        out.append((number, target, resolved, unquote(anchor)))
    return out


def link_problems(path: Path, *, into_results: bool) -> list[str]:
    problems = []
    for number, target, resolved, anchor in relative_links(path):
        if (resolved == RESULTS.resolve()) != into_results:
            continue
        where = f"{_rel(path)}:{number}: ({target})"
        if not resolved.is_relative_to(ROOT):
            problems.append(f"{where} leads out of the repository")
        elif not resolved.exists():
            problems.append(f"{where} names no file of the repository")
        elif anchor and resolved.suffix == ".md" and resolved.is_file() and anchor.lower() not in anchors(resolved):
            problems.append(f"{where} names no heading of {_rel(resolved)}")
    return problems


@pytest.mark.parametrize("path", link_files(), ids=_rel)
def test_relative_links_resolve(path):
    problems = link_problems(path, into_results=False)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", link_files(), ids=_rel)
def test_links_into_results_name_its_headings(path):
    """Strict: every `benchmarks/RESULTS.md#anchor` the pages use must be a heading of RESULTS.md."""
    problems = link_problems(path, into_results=True)
    assert not problems, "\n".join(problems)


def test_slugs_follow_github():
    assert slug("What an adapter costs") == "what-an-adapter-costs"
    assert slug("Adapters against the base") == "adapters-against-the-base"
    assert slug("ESFT against full fine-tuning and LoRA") == "esft-against-full-fine-tuning-and-lora"
    assert slug("Memory: slots, the KV cache") == "memory-slots-the-kv-cache"
    assert slug("Keep layers resident: `--paging-adaptive`") == "keep-layers-resident---paging-adaptive"
    assert slug("The [quick start](x.md) and `tiny_world.py`") == "the-quick-start-and-tiny_worldpy"


# ---------------------------------------------------------------------------------------------------------------
# Commands.

SHELL = {"", "bash", "sh", "shell", "console", "zsh"}
ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def shell_lines(path: Path) -> list[tuple[str, str]]:
    """(where, command line) of every line of the file's shell code blocks (continuations joined, prompts and
    comments dropped), and of every inline code span that starts with `esftctl`, `python` or `bash`."""
    text = path.read_text(encoding="utf-8")
    prose, blocks = split_fences(text)
    out = []
    for lang, body in blocks:
        if lang not in SHELL:
            continue
        joined, current = [], ""
        for line in body:
            if line.rstrip().endswith("\\"):
                current += line.rstrip()[:-1] + " "
                continue
            joined.append(current + line)
            current = ""
        if current:
            joined.append(current)
        for line in joined:
            line = re.sub(r"^\s*\$\s+", "", line).strip()
            if line and not line.startswith("#"):
                out.append((f"{_rel(path)} (code block)", line))
    for number, line in enumerate(prose, 1):
        for m in INLINE_CODE.finditer(line):
            span = m.group(2).strip()
            if re.match(r"^((\.venv/bin/)?(esftctl|python3?)|bash)\s", span):
                out.append((f"{_rel(path)}:{number}", span))
    return out


def segments(line: str) -> list[list[str]]:
    """The simple commands of a shell line, as tokens: split at pipes, `&&`, `||` and `;`, outside quotes."""
    try:
        lexer = shlex.shlex(line, posix=True, punctuation_chars="|&;")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        tokens = list(lexer)
    except ValueError:  # an unbalanced quote: a prose fragment, not a command
        return []
    out, current = [], []
    for token in tokens:
        if token and set(token) <= set("|&;"):
            out.append(current)
            current = []
        else:
            current.append(token)
    out.append(current)
    return [s for s in out if s]


def is_placeholder(token: str) -> bool:
    """A token that stands for something (COMMAND, PATH..., token|gate, [--flag]): not a literal name."""
    return (token.isupper() or "..." in token or "|" in token or token.startswith(("[", "(", "<"))
            or token in ("...",))


@functools.cache
def cli():
    import typer.main

    from esftctl.cli import app

    return app, typer.main.get_command(app)


@functools.cache
def help_text(path: tuple[str, ...]) -> str:
    from typer.testing import CliRunner

    app, _ = cli()
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "300", "NO_COLOR": "1"})
    assert result.exit_code == 0, f"`esftctl {' '.join(path)} --help` exited {result.exit_code}:\n{result.output}"
    return result.output


def option_in_help(option: str, text: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text) is not None


def options_of(tokens: list[str]) -> list[str]:
    """The options a command line uses, up to a bare `--` (what follows goes to vLLM)."""
    out = []
    for token in tokens:
        if token == "--":
            break
        token = token.strip("[](),")
        token = token.split("=", 1)[0]
        if re.fullmatch(r"--[A-Za-z0-9][\w-]*", token) or re.fullmatch(r"-[A-Za-z]", token):
            out.append(token)
    return out


def esftctl_problems(tokens: list[str]) -> list[str]:
    """What is wrong with one `esftctl ...` command (tokens after `esftctl`)."""
    _, root = cli()
    path: list[str] = []
    node = root
    rest = list(tokens)
    problems = []
    # options before the command are the top level's (--allow-unprotected, --version)
    while rest and rest[0].startswith("-") and rest[0] != "--":
        option = rest.pop(0).split("=", 1)[0]
        if not option_in_help(option, help_text(())):
            problems.append(f"`esftctl {option}` is no option of esftctl")
    while hasattr(node, "commands") and rest:  # a group (typer may bring its own click)
        token = rest[0]
        if token in node.commands:
            path.append(rest.pop(0))
            node = node.commands[token]
        elif token in ("--help", "-h") or is_placeholder(token):
            return problems  # `esftctl COMMAND ...` or `esftctl bench --help`: nothing more to check
        else:
            return problems + [f"`esftctl {' '.join([*path, token])}`: no such command"]
    text = help_text(tuple(path))
    for option in options_of(rest):
        if not option_in_help(option, text):
            problems.append(f"`esftctl {' '.join(path)}` has no option {option}")
    return problems


def script_problems(tokens: list[str]) -> list[str]:
    """What is wrong with one `bash X` / `python X` / `python -m M` command."""
    args = list(tokens[1:])
    while args and args[0].startswith("-") and args[0] != "-m":
        args.pop(0)  # interpreter options (-u, -X ...)
    if not args:
        return []
    if args[0] == "-m":
        if len(args) < 2:
            return [f"`{' '.join(tokens)}`: -m without a module"]
        module, rest = args[1], args[2:]
        if module == "pytest":
            named = [a.split("::")[0] for a in rest if not a.startswith("-") and (a.endswith(".py") or "/" in a)]
            return [f"`{' '.join(tokens)}`: no file {p}" for p in named if not (ROOT / p).exists()]
        if module.split(".")[0] != "esftctl":
            return []
        parts = module.split(".")[1:]
        base = ROOT / "esftctl" / Path(*parts) if parts else ROOT / "esftctl"
        if not (base.with_suffix(".py").is_file() or (base / "__main__.py").is_file()):
            return [f"`{' '.join(tokens)}`: no module {module} in the repository"]
        return []
    script = args[0]
    if is_placeholder(script):
        return []
    if not (ROOT / script).is_file():
        return [f"`{' '.join(tokens)}`: no script {script} in the repository"]
    return []


def command_problems(line: str) -> list[str]:
    problems = []
    for tokens in segments(line):
        while tokens and ENV.match(tokens[0]):
            tokens = tokens[1:]  # VAR=value before the command
        if not tokens:
            continue
        head = tokens[0]
        if head == "esftctl" or head.endswith("/esftctl"):
            problems += esftctl_problems(tokens[1:])
        elif head == "bash" or re.fullmatch(r"(.*/)?python3?", head):
            problems += script_problems(tokens)
    return problems


@pytest.mark.parametrize("path", doc_files(), ids=_rel)
def test_commands_shown_exist(path):
    problems = []
    for where, line in shell_lines(path):
        problems += [f"{where}: {p}" for p in command_problems(line)]
    assert not problems, "\n".join(problems)


def test_the_command_check_catches_mistakes():
    assert command_problems("esftctl serve BASE --adapter a=b -- --max-model-len 256") == []
    assert command_problems("esftctl --allow-unprotected inspect OLD") == []
    assert command_problems("esftctl bench serve --no-such") == ["`esftctl bench serve` has no option --no-such"]
    assert command_problems("esftctl bench nosuch") == ["`esftctl bench nosuch`: no such command"]
    assert command_problems("bash recipes/quickstart.sh && python recipes/nosuch.py") == [
        "`python recipes/nosuch.py`: no script recipes/nosuch.py in the repository"]
    assert command_problems("python -m esftctl.vllm_generate A B C") == []
    assert command_problems("python -m esftctl.nosuch") == ["`python -m esftctl.nosuch`: no module esftctl.nosuch in "
                                                            "the repository"]


# ---------------------------------------------------------------------------------------------------------------
# The README's shape, and words that belong to the team's history, not to a user's page.


def test_readme_is_one_screen_to_a_first_success():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; at most 200"
    first = next((i for i, line in enumerate(lines, 1) if "curl " in line), None)
    assert first is not None and first <= 100, f"the first curl request is at line {first}; within 100 wanted"
    assert any("/v1/completions" in line for line in lines[first - 1:first + 2])


INTERNAL = re.compile(r"\bissues? #?\d+|\bsessions?\b|#\d{2,}\b", re.I)


@pytest.mark.parametrize("path", doc_files(), ids=_rel)
def test_no_internal_references(path):
    hits = [f"{_rel(path)}:{n}: {line.strip()[:100]}" for n, line in
            enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if INTERNAL.search(line)]
    assert not hits, "\n".join(hits)
