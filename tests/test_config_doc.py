"""``rlite config --doc``: the resolved config with each field's docstring as a comment above it."""

from __future__ import annotations

from pathlib import Path

import yaml

from rlite.config.docs import field_docs
from rlite.config.schema import RolloutConfig
from rlite.tools.cli import main

REPO = Path(__file__).resolve().parent.parent


def comment_above(lines: list[str], entry: str) -> str:
    """The ``# ...`` comment lines right above the line ``entry`` (joined)."""
    index = lines.index(entry)
    above = []
    for line in reversed(lines[:index]):
        if not line.lstrip().startswith("# "):
            break
        above.insert(0, line.lstrip()[2:])
    return " ".join(above)


def test_field_docs_reads_the_docstrings_under_the_fields():
    docs = field_docs(RolloutConfig)
    assert docs["samples_per_prompt"] == "Completions sampled per prompt (the group size of GRPO)."
    assert docs["timeout_s"].startswith("Timeout of any single engine call")


def test_config_doc_prints_each_fields_docstring_next_to_its_value(capsys):
    config = str(REPO / "configs" / "quickstart.yaml")
    assert main(["config", config, "rollout.max_new_tokens=9"]) == 0
    plain = capsys.readouterr().out
    assert main(["config", "--doc", config, "rollout.max_new_tokens=9"]) == 0
    documented = capsys.readouterr().out
    # the same config, comments aside
    assert yaml.safe_load(documented) == yaml.safe_load(plain)
    lines = documented.splitlines()
    assert comment_above(lines, "  max_new_tokens: 9") == "Maximum completion length in tokens."
    assert comment_above(lines, "  samples_per_prompt: 16").startswith("Completions sampled per prompt")
    assert comment_above(lines, "rollout:") == "Generation."
    # a plugin's option, from the config class the plugin registered
    assert comment_above(lines, "      norm_by_std: true").startswith("Divide by the reward std")
    assert comment_above(lines, "        filename: metrics.jsonl") == "File name inside the run folder."
    # every field of the schema and every plugin option has its comment (a choice's name and args are its field's)
    keys = [(i, line) for i, line in enumerate(lines) if not line.lstrip().startswith("#")]
    undocumented = [line for i, line in keys
                    if line.strip().removeprefix("- ").split(":")[0] not in ("name", "args")
                    and not lines[i - 1].lstrip().startswith("# ")]  # fmt: skip
    assert undocumented == []
