"""examples/gsm8k/prepare_gsm8k.py writes GSM8K where and how configs/qwen2.5_gpu.yaml reads it: from a
tiny parquet file and a tiny jsonl file in GSM8K's published layout, made here (no network)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlite.config import load_config
from rlite.data import load_prompt_splits
from rlite.plugin_manager import build_plugin_manager
from rlite.tokenizer import build_byte_tokenizer

REPO = Path(__file__).resolve().parents[2]

# GSM8K's layout: the worked solution, calculator annotations <<...>> included, ends with "#### <answer>"
TRAIN = [
    {"question": "Sam has 3 apples and buys 4 more. How many?", "answer": "He has 3+4=<<3+4=7>>7 apples.\n#### 7"},
    {"question": "A farm sells 1,000 eggs a day, 200 more on Sunday. Sunday?",
     "answer": "1,000+200=<<1000+200=1200>>1,200\n#### 1,200"},
    {"question": "It is 2 degrees and drops 7. Temperature?", "answer": "2-7=<<2-7=-5>>-5\n#### -5"},
]
TEST = [{"question": "Half of 48 muffins are sold. How many are left?", "answer": "48/2=<<48/2=24>>24\n####24 "}]


def prepare_module():
    spec = importlib.util.spec_from_file_location("prepare_gsm8k", REPO / "examples" / "gsm8k" / "prepare_gsm8k.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def gsm8k_files(tmp_path):
    """GSM8K's training split as the Hub's parquet, its test split as grade-school-math's jsonl."""
    train = tmp_path / "download" / "train-00000-of-00001.parquet"
    train.parent.mkdir()
    pq.write_table(pa.Table.from_pylist(TRAIN), train)
    test = tmp_path / "download" / "test.jsonl"
    test.write_text("".join(json.dumps(row) + "\n" for row in TEST))
    return train, test


def test_writes_the_recipes_layout_and_the_recipe_reads_it(tmp_path, gsm8k_files, monkeypatch, capsys):
    train, test = gsm8k_files
    monkeypatch.chdir(tmp_path)  # the default --out data/gsm8k, like the recipe's paths, is relative to here
    assert prepare_module().main(["--train", str(train), "--test", str(test)]) == 0
    written = {split: pq.read_table(tmp_path / "data" / "gsm8k" / f"{split}.parquet").to_pylist()
               for split in ("train", "test")}
    assert written["train"] == [
        {"question": TRAIN[0]["question"], "answer": "7", "solution": TRAIN[0]["answer"]},
        {"question": TRAIN[1]["question"], "answer": "1200", "solution": TRAIN[1]["answer"]},
        {"question": TRAIN[2]["question"], "answer": "-5", "solution": TRAIN[2]["answer"]},
    ]
    assert written["test"] == [{"question": TEST[0]["question"], "answer": "24", "solution": TEST[0]["answer"]}]
    assert "data/gsm8k/train.parquet: 3 rows" in capsys.readouterr().out

    # the GPU recipe, as shipped apart from its model, finds the files and reads prompt and answer from them
    cfg = load_config(REPO / "configs" / "qwen2.5_gpu.yaml", ["model.path=unused"], pm=build_plugin_manager(autoload=False))
    train_set, test_set = load_prompt_splits(cfg.data, build_byte_tokenizer())
    assert [item.row["answer"] for item in train_set.items] == ["7", "1200", "-5"]
    assert [item.row["answer"] for item in test_set.items] == ["24"]
    first = train_set.items[0].prompt_text
    assert TRAIN[0]["question"] in first and cfg.data.system_prompt in first


@pytest.mark.parametrize("row, message", [
    ({"question": "q", "answer": "no final line"}, "row 2, field 'answer': no '####' final-answer line"),
    ({"question": "q", "answer": "#### "}, "row 2, field 'answer': nothing after '####'"),
    ({"problem": "q", "answer": "#### 1"}, "row 2 has no text field 'question'"),
])
def test_a_bad_row_is_refused_naming_file_and_row(tmp_path, gsm8k_files, capsys, row, message):
    _, test = gsm8k_files
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(TRAIN[0]) + "\n" + json.dumps(row) + "\n")
    assert prepare_module().main(["--train", str(bad), "--test", str(test), "--out", str(tmp_path / "out")]) == 2
    assert f"prepare_gsm8k: {bad}: {message}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing half-written
