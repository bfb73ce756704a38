"""Prompt loading (synthetic task and the three file formats) and the resumable per-rank sampler."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from rlite.config import DataConfig
from rlite.data import PromptSampler, format_prompt, load_prompt_splits
from rlite.tokenizer import build_byte_tokenizer

ROWS = [
    {"prompt": "12+35=", "answer": "47", "id": 0},
    {"prompt": "1+1=", "answer": "2", "id": 1},
    {"prompt": "Reverse the letters: abc", "answer": "cba", "id": 2},
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_byte_tokenizer()


@pytest.fixture(autouse=True)
def offline_hf(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_all_formats(folder: Path, rows: list[dict]) -> dict[str, Path]:
    import datasets

    dataset = datasets.Dataset.from_list(rows)
    paths = {"jsonl": write_jsonl(folder / "rows.jsonl", rows), "parquet": folder / "rows.parquet"}
    dataset.to_parquet(str(paths["parquet"]))
    paths["disk"] = folder / "saved"
    dataset.save_to_disk(str(paths["disk"]))
    return paths


# --------------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------------


def test_synthetic_task_with_chat_template(tokenizer):
    cfg = DataConfig(task="addition", num_train=20, num_eval=5, seed=3)
    train, held_out = load_prompt_splits(cfg, tokenizer)
    assert len(train) == 20 and held_out is not None and len(held_out) == 5
    item = train[0]
    assert item.index == 0
    assert item.prompt_text == f"<|im_start|>user\n{item.row['prompt']}<|im_end|>\n<|im_start|>assistant\n"
    assert item.prompt_ids == tokenizer(item.prompt_text, add_special_tokens=False)["input_ids"]
    assert item.row["answer"] == str(sum(item.row["operands"]))
    assert not {p.row["prompt"] for p in train} & {p.row["prompt"] for p in held_out}


def test_synthetic_task_without_template_and_without_eval(tokenizer):
    cfg = DataConfig(
        task="reversal", task_args={"min_len": 4, "max_len": 4}, num_train=5, num_eval=0, chat_template=False
    )
    train, held_out = load_prompt_splits(cfg, tokenizer)
    assert held_out is None
    assert train[0].prompt_text == train[0].row["prompt"]
    assert train[0].prompt_ids == list(train[0].prompt_text.encode())


def test_synthetic_task_errors_name_the_key(tokenizer):
    with pytest.raises(ValueError, match=r"data\.task: unknown task"):
        load_prompt_splits(DataConfig(task="nope"), tokenizer)
    with pytest.raises(ValueError, match=r"data\.task_args"):
        load_prompt_splits(DataConfig(task="addition", task_args={"bogus": 1}), tokenizer)


def test_system_prompt_is_prepended(tokenizer):
    text = format_prompt("12+35=", tokenizer, chat_template=True, system_prompt="Answer with a number.")
    assert text.startswith("<|im_start|>system\nAnswer with a number.<|im_end|>\n<|im_start|>user\n12+35=")
    messages = [{"role": "system", "content": "own"}, {"role": "user", "content": "hi"}]
    text = format_prompt(messages, tokenizer, chat_template=True, system_prompt="ignored")
    assert "ignored" not in text and text.startswith("<|im_start|>system\nown")


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "disk"])
def test_file_formats_give_identical_items(tmp_path, tokenizer, fmt):
    paths = write_all_formats(tmp_path, ROWS)
    train, held_out = load_prompt_splits(DataConfig(train_files=str(paths[fmt])), tokenizer)
    assert held_out is None
    reference, _ = load_prompt_splits(DataConfig(task="addition", num_train=1, num_eval=0), tokenizer)
    assert [p.row for p in train] == ROWS
    assert [p.index for p in train] == [0, 1, 2]
    for item, row in zip(train, ROWS):
        expected = format_prompt(row["prompt"], tokenizer, chat_template=True)
        assert item.prompt_text == expected
        assert item.prompt_ids == tokenizer(expected, add_special_tokens=False)["input_ids"]
    assert not list((tmp_path / "hf-home").rglob("*.arrow"))  # no cache copies left behind


def test_chat_message_prompts_and_custom_columns(tmp_path, tokenizer):
    rows = [
        {"messages": [{"role": "user", "content": "What is 2+2?"}], "solution": "4"},
        {"messages": [{"role": "user", "content": "What is 3+3?"}], "solution": "6"},
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    cfg = DataConfig(
        train_files=str(path), prompt_key="messages", answer_key="solution", system_prompt="Be brief."
    )
    train, _ = load_prompt_splits(cfg, tokenizer)
    assert train[1].row["answer"] == "6" and train[1].row["solution"] == "6"
    assert train[1].row["prompt"] == rows[1]["messages"]
    assert train[1].prompt_text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 3+3?<|im_end|>\n<|im_start|>assistant\n"
    )
    with pytest.raises(ValueError, match="chat_template is false"):
        load_prompt_splits(
            DataConfig(
                train_files=str(path), prompt_key="messages", answer_key="solution", chat_template=False
            ),
            tokenizer,
        )


def test_eval_files_capped_by_num_eval(tmp_path, tokenizer):
    train_path = write_jsonl(tmp_path / "train.jsonl", ROWS)
    eval_path = write_jsonl(tmp_path / "eval.jsonl", ROWS * 2)
    _, held_out = load_prompt_splits(
        DataConfig(train_files=str(train_path), eval_files=str(eval_path), num_eval=4), tokenizer
    )
    assert len(held_out) == 4
    _, held_out = load_prompt_splits(
        DataConfig(train_files=str(train_path), eval_files=str(eval_path), num_eval=0), tokenizer
    )
    assert len(held_out) == 6


def test_saved_dataset_dict_picks_the_split(tmp_path, tokenizer):
    import datasets

    folder = tmp_path / "dd"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:1])}
    ).save_to_disk(str(folder))
    train, held_out = load_prompt_splits(
        DataConfig(train_files=str(folder), eval_files=str(folder)), tokenizer
    )
    assert len(train) == 3 and len(held_out) == 1


def test_long_prompts_are_dropped_and_counted(tmp_path, tokenizer, caplog):
    rows = [*ROWS, {"prompt": "x" * 500, "answer": "1", "id": 3}]
    path = write_jsonl(tmp_path / "long.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="rlite.data"):
        train, _ = load_prompt_splits(
            DataConfig(train_files=str(path), chat_template=False, max_prompt_tokens=30), tokenizer
        )
    assert [p.row["id"] for p in train] == [0, 1, 2]
    assert train.num_dropped == 1
    assert "dropped 1 of 4" in caplog.text
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        load_prompt_splits(DataConfig(train_files=str(path), max_prompt_tokens=2), tokenizer)


def test_missing_file_names_key_and_path(tmp_path, tokenizer):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match=r"data\.train_files") as info:
        load_prompt_splits(DataConfig(train_files=str(missing)), tokenizer)
    assert str(missing) in str(info.value)
    train_path = write_jsonl(tmp_path / "train.jsonl", ROWS)
    with pytest.raises(FileNotFoundError, match=r"data\.eval_files"):
        load_prompt_splits(DataConfig(train_files=str(train_path), eval_files=str(missing)), tokenizer)


def test_missing_columns_are_named(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    with pytest.raises(ValueError, match=r"no column 'question'.*Columns present: prompt, answer, id"):
        load_prompt_splits(DataConfig(train_files=str(path), prompt_key="question"), tokenizer)
    with pytest.raises(ValueError, match=r"no column 'label' \(data\.answer_key\)"):
        load_prompt_splits(DataConfig(train_files=str(path), answer_key="label"), tokenizer)


def test_empty_dataset_and_bad_extension(tmp_path, tokenizer):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match=r"data\.train_files.*no rows"):
        load_prompt_splits(DataConfig(train_files=str(empty)), tokenizer)
    csv = tmp_path / "rows.csv"
    csv.write_text("prompt,answer\n1+1=,2\n")
    with pytest.raises(ValueError, match=r"data\.train_files.*unsupported extension '\.csv'"):
        load_prompt_splits(DataConfig(train_files=str(csv)), tokenizer)


# --------------------------------------------------------------------------------------------------
# sampling
# --------------------------------------------------------------------------------------------------


def _take(sampler: PromptSampler, steps: int) -> list[list[int]]:
    return [[item.index for item in next(sampler)] for _ in range(steps)]


@pytest.fixture(scope="module")
def items(tokenizer):
    train, _ = load_prompt_splits(
        DataConfig(task="addition", num_train=10, num_eval=0, chat_template=False), tokenizer
    )
    return train.items


def test_each_epoch_is_a_permutation(items):
    sampler = PromptSampler(items, prompts_per_step=5, seed=0)
    steps = _take(sampler, 6)  # three epochs of ten
    epochs = [steps[0] + steps[1], steps[2] + steps[3], steps[4] + steps[5]]
    assert all(sorted(e) == list(range(10)) for e in epochs)
    assert epochs[0] != epochs[1]  # reshuffled
    assert sampler.state_dict() == {"epoch": 2, "position": 10, "num_items": 10}


def test_deterministic_and_seeded(items):
    assert _take(PromptSampler(items, 4, seed=1), 5) == _take(PromptSampler(items, 4, seed=1), 5)
    assert _take(PromptSampler(items, 4, seed=1), 5) != _take(PromptSampler(items, 4, seed=2), 5)


def test_no_shuffle_keeps_order_and_crosses_epochs(items):
    assert _take(PromptSampler(items, 4, shuffle=False), 3) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]


def test_batch_larger_than_dataset(items):
    batch = _take(PromptSampler(items, 25, shuffle=False), 1)[0]
    assert batch == list(range(10)) * 2 + list(range(5))


def test_ranks_split_the_global_batch(items):
    single = _take(PromptSampler(items, 6, seed=4), 7)
    ranks = [_take(PromptSampler(items, 6, rank=r, world_size=3, seed=4), 7) for r in range(3)]
    for step in range(7):
        assert ranks[0][step] + ranks[1][step] + ranks[2][step] == single[step]
        assert all(len(r[step]) == 2 for r in ranks)


def test_indivisible_batch_is_refused(items):
    with pytest.raises(ValueError, match=r"prompts_per_step=5.*world size 2"):
        PromptSampler(items, 5, rank=0, world_size=2)


@pytest.mark.parametrize("stop_after", [0, 1, 3, 4, 7])
def test_resume_sees_the_same_prompts(items, stop_after):
    uninterrupted = _take(PromptSampler(items, 4, seed=9), 10)
    first = PromptSampler(items, 4, seed=9)
    before = _take(first, stop_after)
    state = json.loads(json.dumps(first.state_dict()))  # as it would come back from a checkpoint
    resumed = PromptSampler(items, 4, seed=9)
    resumed.load_state_dict(state)
    assert before + _take(resumed, 10 - stop_after) == uninterrupted


def test_resume_with_other_data_is_refused(items):
    state = PromptSampler(items, 2).state_dict()
    with pytest.raises(ValueError, match="10 prompts"):
        PromptSampler(items[:5], 2).load_state_dict(state)


# --------------------------------------------------------------------------------------------------
# many files, nested columns, bad rows
# --------------------------------------------------------------------------------------------------

MORE = [{"prompt": f"{i}+{i}=", "answer": str(2 * i), "id": 10 + i} for i in range(4)]


def test_lists_globs_and_folders_read_every_file_in_order(tmp_path, tokenizer):
    import datasets

    shards = tmp_path / "shards"
    (shards / "part=b").mkdir(parents=True)
    (shards / "part=a").mkdir()
    datasets.Dataset.from_list(MORE[2:]).to_parquet(str(shards / "part=b" / "0.parquet"))
    datasets.Dataset.from_list(MORE[:2]).to_parquet(str(shards / "part=a" / "0.parquet"))
    first = write_jsonl(tmp_path / "first.jsonl", ROWS[:1])
    second = write_jsonl(tmp_path / "second.jsonl", ROWS[1:])
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(ROWS[::-1]).save_to_disk(str(saved))

    def ids(files) -> list[int]:
        train, _ = load_prompt_splits(DataConfig(train_files=files), tokenizer)
        return [item.row["id"] for item in train]

    assert ids(str(tmp_path / "*.jsonl")) == [0, 1, 2]  # a glob, sorted
    assert ids([str(second), str(first)]) == [1, 2, 0]  # a list, in its order
    assert ids(str(shards)) == [10, 11, 12, 13]  # a parquet folder, partitions sorted and searched recursively
    assert ids(str(shards / "**" / "*.parquet")) == [10, 11, 12, 13]
    assert ids([str(first), str(saved), str(shards)]) == [0, 2, 1, 0, 10, 11, 12, 13]  # formats mixed
    assert ids(str(saved)) == [2, 1, 0]  # a save_to_disk folder by its local path
    with pytest.raises(FileNotFoundError, match=r"data\.train_files: '.*nothing-\*\.jsonl' matches no file"):
        ids(str(tmp_path / "nothing-*.jsonl"))
    with pytest.raises(FileNotFoundError, match=r"data\.train_files: '.*missing\.jsonl' does not exist"):
        ids([str(first), str(tmp_path / "missing.jsonl")])
    (tmp_path / "empty-folder").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no .jsonl, .json, .parquet file"):
        ids(str(tmp_path / "empty-folder"))


def test_a_list_of_files_from_the_command_line(tmp_path, pm):
    from rlite.config import load_config

    cfg = load_config(None, ["model.path=m", f"data.train_files=[{tmp_path}/a.jsonl, {tmp_path}/b.jsonl]"], pm=pm)
    assert cfg.data.train_files == [f"{tmp_path}/a.jsonl", f"{tmp_path}/b.jsonl"]
    assert load_config(None, ["model.path=m", "data.train_files=a.jsonl"], pm=pm).data.train_files == "a.jsonl"


def test_nested_columns_like_verl_parquet(tmp_path, tokenizer):
    import datasets

    rows = [
        {"prompt": [{"role": "user", "content": f"What is {i}+{i}?"}], "data_source": "toy",
         "reward_model": {"style": "rule", "ground_truth": str(2 * i)}, "extra_info": {"index": i}}
        for i in range(3)
    ]  # fmt: skip
    path = tmp_path / "verl.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    train, _ = load_prompt_splits(
        DataConfig(train_files=str(path), answer_key="reward_model.ground_truth"), tokenizer
    )
    assert [item.row["answer"] for item in train] == ["0", "2", "4"]
    assert train[1].row["reward_model"] == {"style": "rule", "ground_truth": "2"}  # the row is kept whole
    assert train[1].prompt_text.endswith("What is 1+1?<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError, match=r"no column 'reward_model\.truth'.*reward_model has no 'truth' \(it holds: style, ground_truth\)"):
        load_prompt_splits(DataConfig(train_files=str(path), answer_key="reward_model.truth"), tokenizer)


def test_empty_prompts_are_dropped_and_counted(tmp_path, tokenizer, caplog):
    rows = [ROWS[0], {"prompt": "", "answer": "1", "id": 5}, ROWS[1], {"prompt": "   ", "answer": "1", "id": 6}]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="rlite.data"):
        train, _ = load_prompt_splits(DataConfig(train_files=str(path)), tokenizer)
    assert [item.row["id"] for item in train] == [0, 1] and train.num_dropped == 2
    assert "dropped 2 of 4 rows whose prompt (prompt) is empty, the first at" in caplog.text
    assert "rows.jsonl' row 2" in caplog.text  # 1-based
    only_empty = write_jsonl(tmp_path / "empty.jsonl", rows[1:2])
    with pytest.raises(ValueError, match="every prompt of .* is empty"):
        load_prompt_splits(DataConfig(train_files=str(only_empty)), tokenizer)


def test_row_numbers_in_errors_are_one_based_within_their_file(tmp_path, tokenizer):
    first = write_jsonl(tmp_path / "a.jsonl", ROWS)
    second = write_jsonl(tmp_path / "b.jsonl", [ROWS[0], {"prompt": "x", "answer": None}])
    with pytest.raises(ValueError, match=r"b\.jsonl' row 2 has no value in column 'answer'"):
        load_prompt_splits(DataConfig(train_files=[str(first), str(second)]), tokenizer)
    numbers = write_jsonl(tmp_path / "c.jsonl", [{"prompt": 7, "answer": "1"}])
    with pytest.raises(ValueError, match=r"c\.jsonl' row 1, column 'prompt': a prompt must be a string"):
        load_prompt_splits(DataConfig(train_files=str(numbers)), tokenizer)


def test_a_file_that_is_not_utf8_names_the_file_and_line(tmp_path, tokenizer):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "caf\xe9", "answer": "3"}\n')
    with pytest.raises(ValueError) as info:
        load_prompt_splits(DataConfig(train_files=str(path)), tokenizer)
    message = str(info.value)
    assert message.startswith("data.train_files: ") and f"{str(path)!r} line 2, column 16" in message
    assert "byte 0xe9 is not UTF-8" in message


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_malformed_json_line_names_the_file_and_line(tmp_path, tokenizer, suffix):
    path = tmp_path / f"rows{suffix}"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": "2+2=", "answer": "4"}\n{"prompt": "3+3=", "answer: "6"}\n')
    with pytest.raises(ValueError) as info:
        load_prompt_splits(DataConfig(train_files=str(path)), tokenizer)
    message = str(info.value)
    assert f"data.train_files: {str(path)!r} line 4, column" in message and "not valid JSON" in message
