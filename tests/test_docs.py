"""The documentation (README.md and docs/*.md) against the repository: every relative link names a file that exists
(and an #anchor into a markdown file, one of its headings), every script has its page, and every --flag is a flag of
the command it is written for: on a script's page, that script's unless the flag follows another command
(`python benchmark/sweep.py ...`, `pip ...`); and no speed (steps/s) or duration of a script, or of the test suite,
is stated in two pages with different values. Fast: the scripts and tools are read with ast, never run."""

import ast
import re

import pytest

from tests.conftest import REPO, SCRIPTS

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TOOLS = ["sweep", "report", "speed", "erl_population", "profile_update", "anchors"]  # benchmark/*.py, argparse
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


# A figure stated twice differently: the speed (steps/s) or a duration of one script on one device, in two pages.
NAMES = {
    "discrete SAC": "sac_discrete",
    "ERL-TD3": "erl_td3",
    "ERL": "erl_td3",
    "TD7": "td7_continuous",
    "TD3": "td3_continuous",
    "SAC": "sac_continuous",
    "test suite": "the test suite",
    "pytest tests": "the test suite",
    **{script: script for script in SCRIPTS},
}
NAME = re.compile("|".join(rf"\b{re.escape(n)}\b" for n in sorted(NAMES, key=len, reverse=True)))
DIGITS = r"\d+(?:,\d{3})*(?:\.\d+)?"
NUMBER = rf"(?<![\w.,-]){DIGITS}"  # not the 4 of "Hopper-v4"
AMOUNT = rf"(?<!every )(?:about |~)?({NUMBER}(?:\s*(?:-|to)\s*{DIGITS})?)"  # "every 2 s" is a period, not a figure
SPEED = re.compile(rf"{AMOUNT}\s+(?:env\s+)?steps/s")
DURATION = re.compile(rf"{AMOUNT}\s*(seconds?|s|min|minutes?|hours?|days?)\b")
SECONDS = {"s": 1, "min": 60, "h": 3600, "d": 86400}
STEPS = re.compile(
    rf"({NUMBER})\s*([kM])?[- ](?:env |random )?steps?\b|\b({NUMBER})([kM])\b|--total-timesteps[ =](\d+)"
)
GPU, CPU = re.compile(r"\bGPUs?\b|\bCUDA\b|\bH200\b"), re.compile(r"\bCPUs?\b|\bcores?\b")


def number(text):
    return float(text.replace(",", ""))


def amount(text, scale=1):
    """'154-162' or '154 to 162' -> (154.0, 162.0); '300' -> (300.0, 300.0); times scale."""
    low, _, high = re.sub(r"\s*to\s*", "-", text).partition("-")
    return (number(low) * scale, number(high or low) * scale)


def workload(sentence, start):
    """The step count of a duration at `start`: the largest one named before it in its sentence (a run's total, not
    its random steps), else the largest one named after it, else None."""

    def counts(text):
        return [
            number(m[1] or m[3] or m[5]) * {"k": 1e3, "M": 1e6}.get(m[2] or m[4], 1)
            for m in STEPS.finditer(text)
            if not (m[1] and "." in m[1] and not m[2])  # "1.5 steps" is no step count
        ]

    return max(counts(sentence[:start]) or counts(sentence), default=None)


def device(sentence, start):
    """'gpu' where the clause holding the figure (else its sentence) names only a GPU; 'cpu' otherwise."""
    clause = re.split(r"[;(]", sentence[:start])[-1] + re.split(r"[;)]", sentence[start:])[0]
    for text in (clause, sentence):
        if GPU.search(text) and not CPU.search(text):
            return "gpu"
        if CPU.search(text):
            return "cpu"
    return "cpu"


def paragraphs(text):
    """A page's prose paragraphs (a table's rows each its own line) and its code lines, comments kept."""
    found, lines, fenced = [], [], False
    for line in [*text.splitlines(), ""]:
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced:
            found.append(line)
        elif line.strip():
            lines.append(line)
            continue
        if lines:
            table = lines[0].lstrip().startswith("|")
            found.append("\n".join(lines) if table else " ".join(lines))
            lines = []
    return found


def figures(text, owner=None):
    """{(kind, script, device[, steps]): {figure}} for every steps/s and duration figure of a page's prose and code
    comments. Its script: the nearest one named before it in its sentence, else the first after it there, else the
    last one named in its paragraph before, else the page's own (None: the figure is not kept)."""
    found = {}
    for paragraph in paragraphs(text):
        script = owner
        for sentence in re.split(r"(?<=[.!?])\s+(?=[A-Z(*`\[])|\n", paragraph):
            if sentence.lstrip().startswith("|"):  # a table's row: its own script or the page's
                script = owner
            marks = [(m.start(), NAMES[m.group()]) for m in NAME.finditer(sentence)]
            for kind, pattern in (("steps/s", SPEED), ("duration", DURATION)):
                for m in pattern.finditer(sentence):
                    before, after = [s for at, s in marks if at < m.start()], [s for at, s in marks if at > m.start()]
                    who = before[-1] if before else after[0] if after else script
                    if who is None:
                        continue
                    if kind == "steps/s":
                        key, value = (kind, who, device(sentence, m.start())), amount(m[1])
                    else:
                        key = (kind, who, device(sentence, m.start()), workload(sentence, m.start()))
                        value = amount(m[1], SECONDS["min" if m[2].startswith("min") else m[2][0]])
                    found.setdefault(key, set()).add(value)
            if marks:
                script = marks[-1][1]
    return found


def figure_conflicts(pages):
    """The figures (a script's steps/s on a device; its duration on a device for one step count) that two pages
    state with different values: each should be stated once, in the page that owns it, and linked from the others."""
    by_key = {}
    for name, text, owner in pages:
        for key, values in figures(text, owner).items():
            by_key.setdefault(key, {})[name] = values
    problems = []
    for key, pages_values in sorted(by_key.items(), key=str):
        if len({frozenset(v) for v in pages_values.values()}) > 1:
            said = "; ".join(f"{name}: {sorted(values)}" for name, values in sorted(pages_values.items()))
            problems.append(f"{' '.join(str(k) for k in key if k is not None)} differs between pages: {said}")
    return problems


def doc_pages():
    return [(p.relative_to(REPO).as_posix(), p.read_text(), p.stem if p.stem in SCRIPTS else None) for p in PAGES]


def test_no_figure_is_stated_twice_differently():
    assert not figure_conflicts(doc_pages()), "\n".join(figure_conflicts(doc_pages()))


def test_the_figure_check_finds_a_second_figure():
    """A speed restated with another value, or a run's duration, fails; the same figure twice, or figures of
    other scripts, devices or step counts, do not."""
    readme = (
        "TD7 runs about 50 steps/s alone on a 2-core CPU (30 with one thread). On a GPU TD7 runs 400 steps/s.\n\n"
        "```bash\npython td3_continuous.py   # Hopper-v4, 1M steps: about 2.7 hours on a CPU\n```\n\n"
        "The quick start takes 94-97 seconds at 20,000 steps with `sac_discrete.py`. The test suite took 25 min.\n"
    )
    td7 = "On a CPU it runs about 23 steps/s with one thread. SAC runs 202 steps/s.\n"
    td3 = "TD3's default run, 1M steps, runs at about 300 steps/s (56 minutes of steps at that speed).\n"
    discrete = "Its 20,000 steps take 1.6 min on a CPU; 100k steps take 8 minutes.\n"
    assert figure_conflicts(
        [
            ("README.md", readme, None),
            ("td7.md", td7, "td7_continuous"),
            ("td3.md", td3, "td3_continuous"),
            ("discrete.md", discrete, "sac_discrete"),
            ("sac.md", "SAC runs 202 steps/s on a CPU, every 2 s. The test suite took 20 to 30 minutes.", None),
        ]
    ) == [
        "duration sac_discrete cpu 20000.0 differs between pages: README.md: [(94.0, 97.0)]; "
        "discrete.md: [(96.0, 96.0)]",
        "duration td3_continuous cpu 1000000.0 differs between pages: README.md: [(9720.0, 9720.0)]; "
        "td3.md: [(3360.0, 3360.0)]",
        "duration the test suite cpu differs between pages: README.md: [(1500.0, 1500.0)]; sac.md: [(1200.0, 1800.0)]",
        "steps/s td7_continuous cpu differs between pages: README.md: [(50.0, 50.0)]; td7.md: [(23.0, 23.0)]",
    ]
