"""How a model answers with and without the chat template it was trained with (docs/using_the_model.md).

Greedy replies of a model (default: the quickstart's warm start) to the first ``--prompts`` held-out
prompts of the quickstart task (``make_task("addition", 2000, 256, 0, digits=2)``'s eval split), once
through ``rlite generate`` as training formats prompts (the chat template) and once with ``--raw`` (the
bare ``22+95=``), scored by the task's own answer check (:func:`rlite.tasks.is_correct`).

    python benchmarks/chat_template_gap.py [--model examples/warmstart/addition-qwen2-1m] [--prompts 64]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from rlite.tasks import is_correct, make_task


def accuracy(model: str, prompts: Path, out: Path, raw: bool) -> tuple[int, int, str]:
    command = [sys.executable, "-m", "rlite", "generate", model, "--prompts", str(prompts), "--out", str(out)]
    subprocess.run(command + (["--raw"] if raw else []), check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    right = sum(is_correct(row["completion"], row, 0.0) for row in rows)
    return right, len(rows), rows[0]["completion"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="examples/warmstart/addition-qwen2-1m")
    parser.add_argument("--prompts", type=int, default=64)
    args = parser.parse_args()
    _, held_out = make_task("addition", 2000, 256, 0, digits=2)
    with tempfile.TemporaryDirectory() as tmp:
        prompts = Path(tmp) / "prompts.jsonl"
        prompts.write_text("".join(json.dumps(row) + "\n" for row in held_out[: args.prompts]))
        print(f"{args.model}, greedy, the first {args.prompts} held-out prompts (first: {held_out[0]['prompt']!r})")
        for label, raw in (("chat template (as in training)", False), ("--raw (the bare prompt)", True)):
            right, total, first = accuracy(args.model, prompts, Path(tmp) / f"{raw}.jsonl", raw)
            print(f"  {label:32s} {right / total:.2f} ({right}/{total}); first reply {first[:24]!r}")


if __name__ == "__main__":
    main()
