"""What README.md and docs/ state can be checked, and is.

- every repository path they name (in backticks, or as a relative link) exists, named as it is in a
  clone (`trainer/...`, `plugins/...`; the installed names are module paths, `rlite.x`);
- every `rlite COMMAND` they show is a command of the CLI, and every `--flag` of a
  `python SCRIPT.py ...` command they show is one the script defines;
- a section that states a measured result (a ratio such as `2.16x`, a change such as `0.33 → 0.64`,
  a duration such as `2 min 50 s`) cites `benchmarks/RESULTS.md`, and the ratios and changes it states
  appear there as written (rounding a number is a new claim: quote it);
- every entry of `benchmarks/RESULTS.md` says its date, machine and command;
- the README's test command is the one CI runs.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").glob("**/README.md"))]
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
REPO_PREFIXES = ("trainer/", "plugins/", "configs/", "tests/", "benchmarks/", "examples/", "docs/", ".ci/", "rlite/")
MEASURED = re.compile(r"(?<![\w.])\d+\.\d+x(?!\w)|\d\.\d+ ?(?:→|->) ?\d\.\d+|\d+ min \d+ s")


def doc_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def backticked(text: str) -> list[tuple[int, str]]:
    """``(line, span)`` of every inline code span and every line of a fenced code block."""
    spans, fence = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        if fence:
            spans.append((number, line))
        else:
            spans.extend((number, m.group(1)) for m in re.finditer(r"`([^`]+)`", line))
    return spans


def repo_paths(span: str) -> list[str]:
    found = []
    for token in span.replace("(", " ").replace(")", " ").replace(",", " ").split():
        token = token.split("::")[0].split("#")[0].rstrip(".,:;'\"")
        token = token.split("=", 1)[-1]  # `--out=benchmarks/x.png`
        if token.startswith(REPO_PREFIXES) and not re.search(r"[*{}<>$\[\]|]|\.\.\.", token):
            found.append(token)
    return found


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_every_path_a_doc_names_exists(doc: Path) -> None:
    text = doc.read_text()
    missing = []
    for line, span in backticked(text):
        for path in repo_paths(span):
            if path.startswith("rlite/"):
                missing.append(f"line {line}: `{path}` is the installed name; a clone has trainer/ (plugins/ for rlite/plugins/)")
            elif not (ROOT / path).exists():
                missing.append(f"line {line}: `{path}`")
    for number, line in enumerate(text.splitlines(), 1):
        for link in re.findall(r"\]\(([^)\s]+)\)", line):
            if link.startswith(("http://", "https://", "#", "mailto:")):
                continue
            if not (doc.parent / link.split("#")[0]).exists():
                missing.append(f"line {number}: link ({link})")
    assert not missing, f"{doc_id(doc)} names paths that do not exist:\n" + "\n".join(missing)


def cli_commands() -> set[str]:
    from rlite.tools.cli import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    return set(sub.choices)


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_every_command_a_doc_shows_exists(doc: Path) -> None:
    commands, wrong = cli_commands(), []
    for line, span in backticked(doc.read_text()):
        for m in re.finditer(r"(?:^|&&\s*|;\s*|\|\s*|\$\s*|-m\s+)rlite ([a-z][a-z_-]*)", span.strip()):
            if m.group(1) not in commands:
                wrong.append(f"line {line}: `rlite {m.group(1)}` (commands: {sorted(commands)})")
        for m in re.finditer(r"python3? (?:-m \S+ )?((?:benchmarks|examples|tests)/\S+\.py)((?: [^;&|]*)?)", span):
            script = ROOT / m.group(1)
            if not script.is_file():
                continue  # the path check names it
            source = script.read_text()
            for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", m.group(2)):
                if f'"{flag}"' not in source and f"'{flag}'" not in source:
                    wrong.append(f"line {line}: {m.group(1)} has no option {flag}")
    assert not wrong, f"{doc_id(doc)} shows commands that do not exist:\n" + "\n".join(wrong)


def sections(text: str) -> list[tuple[int, str]]:
    out, lines, start = [], [], 1
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("#") and lines:
            out.append((start, "\n".join(lines)))
            lines, start = [], number
        lines.append(line)
    out.append((start, "\n".join(lines)))
    return out


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_measured_results_cite_results_md_and_appear_there_as_written(doc: Path) -> None:
    results = RESULTS.read_text().replace("->", "→")
    wrong = []
    for line, section in sections(doc.read_text()):
        found = MEASURED.findall(section)
        if not found:
            continue
        if "RESULTS.md" not in section:
            wrong.append(f"section at line {line} states {found[:4]} without citing benchmarks/RESULTS.md")
        for claim in found:
            if " min " not in claim and claim.replace("->", "→") not in results:
                wrong.append(f"section at line {line}: {claim!r} is not in benchmarks/RESULTS.md")
    assert not wrong, f"{doc_id(doc)}:\n" + "\n".join(wrong)


def test_every_results_entry_says_its_date_machine_and_command() -> None:
    incomplete = []
    for entry in re.split(r"(?m)^## ", RESULTS.read_text())[1:]:
        title = entry.splitlines()[0]
        lacks = [what for what, pattern in (("date", r"20\d\d-\d\d-\d\d"), ("machine", r"(?i)machine"),
                                            ("command", r"(?i)command")) if not re.search(pattern, entry)]
        if lacks:
            incomplete.append(f"{title!r} lacks: {', '.join(lacks)}")
    assert not incomplete, "benchmarks/RESULTS.md entries:\n" + "\n".join(incomplete)


def code_block_after(text: str, heading: str) -> list[str]:
    after = text[text.index(heading):]
    block = after[after.index("```") :].split("\n", 1)[1]
    return [line for line in block[: block.index("```")].splitlines() if line.strip()]


def test_the_readme_test_command_is_the_command_ci_runs() -> None:
    readme_command = code_block_after((ROOT / "README.md").read_text(), "## Tests")
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith(("#", "set ", "cd "))]  # fmt: skip
    assert readme_command == ["bash tests/run.sh"]
    assert ci == readme_command
    # and the command installs every extra some test needs (megatron's tests must not skip for a user)
    run = (ROOT / "tests" / "run.sh").read_text()
    extras = re.search(r'pip install -q -e "\.\[([\w,]+)\]"', run).group(1).split(",")
    assert {"test", "megatron", "wandb", "tensorboard", "math", "bench"} <= set(extras)
    assert re.search(r"(?m)^python -m pytest -q", run)


CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def torch_installs(text: str) -> list[list[str]]:
    """The arguments of every ``pip install torch...`` in ``text`` (each up to the next ``&&``, ``;``, ``#`` or
    line end), ``-q`` left out."""
    found = []
    for match in re.finditer(r"pip install ((?:-q )?torch[^&;#\n]*)", text):
        found.append([word for word in match.group(1).split() if word != "-q"])
    return found


def test_the_readme_installs_cpu_torch_from_pytorchs_cpu_index_and_tests_run_sh_runs_that_line() -> None:
    """PyPI's Linux torch wheel is the CUDA build (several GB): the README's CPU line and its quickstart take
    torch from PyTorch's CPU index, the GPU line from PyPI, and the test command installs with the README's
    CPU line word for word (so CI and the fresh-clone runs, `benchmarks/fresh_clone.py`, run it)."""
    readme = (ROOT / "README.md").read_text()
    install = code_block_after(readme, "## Install")
    quickstart = code_block_after(readme, "## Quickstart")
    (cpu,) = torch_installs(next(line for line in install if "# CPU" in line))
    (gpu,) = torch_installs(next(line for line in install if "# GPU" in line))
    assert cpu[1:] == ["--index-url", CPU_INDEX] and cpu[0].startswith("torch==")
    assert gpu == [cpu[0]]  # the same version, from PyPI
    assert torch_installs(quickstart[0]) == [cpu]
    assert torch_installs((ROOT / "tests" / "run.sh").read_text()) == [cpu]
    # the separate SGLang-compat venv installs the same CPU build (its version is a variable there)
    compat = (ROOT / "tests" / "sglang_compat" / "run.sh").read_text()
    assert f'torch==$TORCH_VERSION" --index-url {CPU_INDEX}' in compat
    assert f"TORCH_VERSION={cpu[0].split('==')[1]}" in compat
    floor = (ROOT / "tests" / "floor" / "run.sh").read_text()  # and the floor probe's venv, by default
    assert f'torch==$TORCH" --index-url {CPU_INDEX}' in floor
    assert f"RLITE_FLOOR_TORCH:-{cpu[0].split('==')[1]}" in floor
    assert "training" in readme[readme.index("## Install"):readme.index("## Quickstart")].split("```")[2]


def test_the_readme_has_one_extras_table_naming_every_extra() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    section = pyproject.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    extras = set(re.findall(r"(?m)^(\w+) = \[", section))
    readme = (ROOT / "README.md").read_text()
    tables = [line for line in readme.splitlines() if line.startswith("| extra |")]
    assert len(tables) == 1
    rows = re.findall(r"(?m)^\| `\[(\w+)\]` \|", readme)
    assert sorted(rows) == sorted(extras)
