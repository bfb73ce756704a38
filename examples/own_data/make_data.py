"""Write this example's data files: 2-digit additions in the layout many RL datasets use (verl's),
the answer nested under ``reward_model.ground_truth``. Deterministic: re-running it rewrites the same
files. Your own data replaces these two files; nothing else in rlite needs this script.

    python examples/own_data/make_data.py      # writes examples/own_data/{train,eval}.jsonl

A row::

    {"question": "23+45=", "reward_model": {"ground_truth": "68", "style": "rule"}, "data_source": "addition"}

The prompts use the format the quickstart's warm start (examples/warmstart/addition-qwen2-1m) was
supervised on, so that model is partly right from the first step and RL has something to improve.
The held-out rows share no (a, b) pair with the training rows.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).parent
NUM_TRAIN, NUM_EVAL = 400, 100


def row(a: int, b: int) -> dict:
    return {"question": f"{a}+{b}=", "reward_model": {"ground_truth": str(a + b), "style": "rule"},
            "data_source": "addition"}


def main() -> None:
    rng = random.Random(7)
    pairs = rng.sample([(a, b) for a in range(10, 100) for b in range(10, 100)], NUM_TRAIN + NUM_EVAL)
    for name, chosen in (("train", pairs[:NUM_TRAIN]), ("eval", pairs[NUM_TRAIN:])):
        lines = [json.dumps(row(a, b)) for a, b in chosen]
        (HERE / f"{name}.jsonl").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
