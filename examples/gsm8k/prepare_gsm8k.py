"""Write GSM8K in the layout ``configs/qwen2.5_gpu.yaml`` reads: ``data/gsm8k/train.parquet`` and
``data/gsm8k/test.parquet``, one row per problem with the columns

* ``question``: the problem, unchanged (the recipe's ``data.prompt_key``);
* ``answer``: the final answer only, the text after ``####`` in GSM8K's solution, stripped, with
  thousands separators removed (``"#### 1,200"`` -> ``"1200"``): what the ``math_verify`` reward
  compares the model's ``\\boxed{}`` answer with (the recipe's ``data.answer_key``);
* ``solution``: GSM8K's full worked solution, kept for reading (rlite ignores it).

From local files, as openai/gsm8k publishes them (the Hugging Face dataset's parquet files, e.g.
``main/train-00000-of-00001.parquet``, or the ``train.jsonl`` / ``test.jsonl`` of the grade-school-math
repository; fields ``question`` and ``answer``)::

    python examples/gsm8k/prepare_gsm8k.py --train PATH/train.jsonl --test PATH/test.jsonl

or, on a machine with network access and the ``datasets`` library (an rlite dependency)::

    python examples/gsm8k/prepare_gsm8k.py --from-hub          # datasets.load_dataset("openai/gsm8k", "main")

Run it from the repository root (``--out`` defaults to ``data/gsm8k``, where the recipe looks).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ANSWER_MARK = "####"
FIELDS = ("question", "answer")


class PrepareError(Exception):
    """Bad input, reported with the file and row it is in."""


def final_answer(solution: str) -> str:
    """The text after the last ``####`` of a GSM8K solution, stripped, thousands separators removed."""
    if ANSWER_MARK not in solution:
        raise ValueError(f"no {ANSWER_MARK!r} final-answer line")
    answer = solution.rsplit(ANSWER_MARK, 1)[1].strip().replace(",", "")
    if not answer:
        raise ValueError(f"nothing after {ANSWER_MARK!r}")
    return answer


def read_file(path: Path) -> list[dict]:
    """The rows of a GSM8K .jsonl or .parquet file."""
    if not path.is_file():
        raise PrepareError(f"{path}: no such file")
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    if path.suffix in (".jsonl", ".json"):
        rows = []
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise PrepareError(f"{path}: line {number} is not JSON: {exc}") from None
        return rows
    raise PrepareError(f"{path}: expected a .jsonl or .parquet file (GSM8K as openai/gsm8k publishes it)")


def convert(rows: list[dict], source: str) -> list[dict]:
    """GSM8K rows (``question``, ``answer`` = worked solution) as the recipe's rows (see the module docstring)."""
    if not rows:
        raise PrepareError(f"{source}: no rows")
    out = []
    for number, row in enumerate(rows, start=1):
        missing = [field for field in FIELDS if not isinstance(row.get(field), str)]
        if missing:
            raise PrepareError(f"{source}: row {number} has no text field {', '.join(map(repr, missing))} "
                               f"(GSM8K rows have 'question' and 'answer'; this row has {', '.join(row) or 'none'})")
        try:
            answer = final_answer(row["answer"])
        except ValueError as exc:
            raise PrepareError(f"{source}: row {number}, field 'answer': {exc}") from None
        out.append({"question": row["question"], "answer": answer, "solution": row["answer"]})
    return out


def write_parquet(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    schema = pa.schema([(name, pa.string()) for name in ("question", "answer", "solution")])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)


def hub_rows() -> dict[str, list[dict]]:
    """GSM8K's train and test splits from the Hugging Face Hub (needs network)."""
    from datasets import load_dataset

    try:
        dataset = load_dataset("openai/gsm8k", "main")
    except Exception as exc:  # noqa: BLE001 - no network, the hub offline, a proxy: one line says which and what to do
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise PrepareError(
            f"--from-hub: could not read openai/gsm8k from the Hugging Face Hub ({type(exc).__name__}: {first_line}). "
            "It needs network access. Without it: copy GSM8K's train and test files onto this machine (the dataset's "
            "main/*.parquet, or the grade-school-math repository's train.jsonl and test.jsonl) and run "
            "python examples/gsm8k/prepare_gsm8k.py --train TRAIN --test TEST"
        ) from None
    return {split: list(dataset[split]) for split in ("train", "test")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train", type=Path, help="GSM8K's training split, a local .jsonl or .parquet file")
    parser.add_argument("--test", type=Path, help="GSM8K's test split, a local .jsonl or .parquet file")
    parser.add_argument("--from-hub", action="store_true", help='read datasets.load_dataset("openai/gsm8k", "main")')
    parser.add_argument("--out", type=Path, default=Path("data/gsm8k"), help="output folder (default: data/gsm8k)")
    args = parser.parse_args(argv)
    if args.from_hub and (args.train or args.test):
        parser.error("--from-hub reads both splits from the Hub: drop --train and --test")
    if not args.from_hub and not (args.train and args.test):
        parser.error("give --train and --test (local GSM8K files), or --from-hub")
    try:
        if args.from_hub:
            splits = {split: convert(rows, f"openai/gsm8k {split}") for split, rows in hub_rows().items()}
        else:
            splits = {split: convert(read_file(path), str(path)) for split, path in (("train", args.train),
                                                                                  ("test", args.test))}
    except PrepareError as exc:
        print(f"prepare_gsm8k: {exc}", file=sys.stderr)
        return 2
    for split, rows in splits.items():
        write_parquet(rows, args.out / f"{split}.parquet")
        print(f"{args.out / f'{split}.parquet'}: {len(rows)} rows (question, answer, solution)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
