"""Write this example's data files: "reverse the word" rows, one JSON object per line, in columns of
your own naming (the config's ``data.prompt_key``/``data.answer_key`` point at them). Deterministic:
re-running it rewrites the same files. Your own data replaces these two files.

    python examples/own_task/make_data.py      # writes examples/own_task/{train,eval}.jsonl

A row::

    {"instruction": "reverse: laze", "target": "ezal", "word": "laze"}

Words are 3-5 random lowercase letters, as the warm start ``examples/warmstart/strings-qwen2-1m`` saw them
(its ``reverse: WORD`` instruction among others); the held-out words share none with the training words.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).parent
NUM_TRAIN, NUM_EVAL = 1000, 128


def row(word: str) -> dict:
    return {"instruction": f"reverse: {word}", "target": word[::-1], "word": word}


def main() -> None:
    rng = random.Random("own_task")
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < NUM_TRAIN + NUM_EVAL:
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 5)))
        if word not in seen:
            seen.add(word)
            words.append(word)
    for name, chosen in (("train", words[:NUM_TRAIN]), ("eval", words[NUM_TRAIN:])):
        (HERE / f"{name}.jsonl").write_text("".join(json.dumps(row(word)) + "\n" for word in chosen))


if __name__ == "__main__":
    main()
