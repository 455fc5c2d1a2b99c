"""The documentation (README.md and docs/*.md) against the repository: every relative link names a file that exists
(and an #anchor into a markdown file, one of its headings), every script has its page, and every --flag is a flag of
the command it is written for: on a script's page, that script's unless the flag follows another command
(`python benchmark/sweep.py ...`, `pip ...`). Fast: the scripts and tools are read with ast, never run."""

import ast
import re

import pytest

from tests.conftest import REPO, SCRIPTS

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TOOLS = ["sweep", "report", "speed", "erl_population"]  # benchmark/*.py, argparse
EXTERNAL = {"pip", "tensorboard", "pytest", "ruff", "taskset", "sbatch", "git", "bash"}  # flags not checked
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
COMMAND = re.compile(r"(?:\S*/)?(\w+)\.py")


def script_flags(path):
    """The flags tyro makes of a script's `Args` dataclass: --name for every field, --no-name for a bool."""
    (args,) = [node for node in ast.parse(path.read_text()).body if getattr(node, "name", None) == "Args"]
    flags = {"--help"}
    for field in args.body:
        if isinstance(field, ast.AnnAssign):
            flag = "--" + field.target.id.replace("_", "-")
            flags.add(flag)
            if isinstance(field.annotation, ast.Name) and field.annotation.id == "bool":
                flags.add("--no-" + flag[2:])
    return flags


def tool_flags(path):
    """The flags of an argparse tool: the --strings of its add_argument calls."""
    calls = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)]
    names = [a.value for c in calls if getattr(c.func, "attr", None) == "add_argument" for a in c.args]
    return {"--help"} | {name for name in names if isinstance(name, str) and name.startswith("--")}


CLIS = {
    **{s: script_flags(REPO / f"{s}.py") for s in SCRIPTS},
    **{t: tool_flags(REPO / f"benchmark/{t}.py") for t in TOOLS},
}
ANY = set().union(*CLIS.values())


def split_page(text):
    """The page's prose and its fenced code blocks' commands (continued lines joined, comments dropped)."""
    prose, commands, fenced = [], [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced:
            commands.append(re.sub(r"(^|\s)#.*", "", line))
        else:
            prose.append(line)
    commands = " ".join(c.rstrip()[:-1] if c.rstrip().endswith("\\") else c + "\n" for c in commands).splitlines()
    return "\n".join(prose), commands


def slug(heading):
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path):
    prose, _ = split_page(path.read_text())
    seen, result = {}, set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", prose, re.M):
        base = slug(heading)
        result.add(base if base not in seen else f"{base}-{seen[base]}")
        seen[base] = seen.get(base, 0) + 1
    return result


def link_problems(page):
    prose, _ = split_page(page.read_text())
    problems = []
    for target in LINK.findall(re.sub(r"`[^`]*`", "code", prose)):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            problems.append(f"{page.name}: link to {target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            problems.append(f"{page.name}: link to {target}: no heading #{anchor} in {file.name}")
    return problems


def flag_uses(chunk, owner):
    """(command, flag) for every --flag in a command line or code span; `owner` is the command of a bare flag."""
    swept = None
    for token in chunk.split():
        token = token.strip("\"'(),;")
        command = COMMAND.fullmatch(token)
        if token in EXTERNAL:
            owner = "external"
        elif command and owner == "sweep" and swept is None:  # the script a sweep runs
            swept = command.group(1)
        elif command:
            owner, swept = command.group(1), None
        elif token == "--" and owner == "sweep":  # the flags after it go to every run
            owner = swept
        else:
            yield from ((owner, flag) for flag in FLAG.findall(token))


def flag_problems(page):
    """Flags that the command they are written for does not accept."""
    prose, commands = split_page(page.read_text())
    page_owner = page.stem if page.stem in SCRIPTS else None  # a script's page: its flags unless said otherwise
    spans = re.findall(r"`([^`]+)`", prose)
    outside = re.sub(r"`[^`]*`", " ", prose)
    uses = [use for chunk in [*commands, *spans] for use in flag_uses(chunk, page_owner)]
    uses += [(page_owner, flag) for flag in FLAG.findall(outside)]  # prose outside code: the page's own flags
    problems = []
    for owner, flag in uses:
        accepted = CLIS.get(owner, ANY) if owner != "external" else {flag}
        if flag not in accepted:
            problems.append(f"{page.name}: {flag} is not a flag of {owner + '.py' if owner in CLIS else 'any script'}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_links_and_anchors_exist(page):
    assert not link_problems(page), "\n".join(link_problems(page))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_flags_are_accepted(page):
    assert not flag_problems(page), "\n".join(flag_problems(page))


def test_every_script_has_a_page_linked_from_the_readme():
    readme = (REPO / "README.md").read_text()
    for script in SCRIPTS:
        assert (REPO / "docs" / f"{script}.md").exists()
        assert f"(docs/{script}.md)" in readme


def test_the_checks_find_a_broken_page(tmp_path):
    """They can fail: a missing file, a missing heading, an unknown flag, and another script's flags in a code span,
    in prose and after a sweep's `--`."""
    (tmp_path / "other.md").write_text("# Other\n\n## Known heading\n")
    page = tmp_path / "td3_continuous.md"
    page.write_text(
        "# TD3\n\n[a](missing.md) [b](other.md#unknown-heading) [c](other.md#known-heading) [d](#td3)\n\n"
        "`--no-such-flag` and `--zs-dim 256`, `--tau 0.005`; in prose --lmbda.\n\n"
        "```bash\npython td7_continuous.py --zs-dim 256 \\\n    --offline   # TD7's, on its own line: accepted\n"
        "python benchmark/sweep.py td3_continuous.py --workers 2 -- --alpha 0.4\n```\n"
    )
    assert link_problems(page) == [
        "td3_continuous.md: link to missing.md: no such file",
        "td3_continuous.md: link to other.md#unknown-heading: no heading #unknown-heading in other.md",
    ]
    assert flag_problems(page) == [
        "td3_continuous.md: --alpha is not a flag of td3_continuous.py",
        "td3_continuous.md: --no-such-flag is not a flag of td3_continuous.py",
        "td3_continuous.md: --zs-dim is not a flag of td3_continuous.py",
        "td3_continuous.md: --lmbda is not a flag of td3_continuous.py",
    ]
