"""Synthetic tasks: correct answers, determinism, disjoint splits, clear errors."""

from __future__ import annotations

import pytest

from rlite.tasks import TASKS, make_task, task_arg_names

ALL_TASKS = sorted(TASKS)


def _expected_answer(row: dict) -> str:
    task = row["task"]
    if task == "addition":
        return str(sum(row["operands"]))
    if task == "reversal":
        return row["word"][::-1]
    if task == "sorting":
        return " ".join(map(str, sorted(row["numbers"])))
    if task == "spell_digits":
        names = "zero one two three four five six seven eight nine".split()
        return " ".join(names[int(d)] for d in row["digits"])
    if task == "python_expression":
        assert row["tests"] == [{"stdin": "", "stdout": str(sum(row["operands"]))}]
        return str(sum(row["operands"]))
    a, b = row["operands"]
    return str({"add": a + b, "sub": a - b, "mul": a * b}[row["operation"]])


@pytest.mark.parametrize("name", ALL_TASKS)
def test_rows_are_well_formed_and_correct(name):
    train, held_out = make_task(name, num_train=200, num_eval=50, seed=0)
    assert len(train) == 200 and len(held_out) == 50
    keys = set(train[0])
    for row in train + held_out:
        assert set(row) == keys and {"prompt", "answer", "task"} <= keys
        assert isinstance(row["prompt"], str) and isinstance(row["answer"], str)
        assert row["task"] == name
        assert row["answer"] == _expected_answer(row)


@pytest.mark.parametrize("name", ALL_TASKS)
def test_splits_are_disjoint_and_distinct(name):
    train, held_out = make_task(name, num_train=300, num_eval=100, seed=1)
    train_prompts = [r["prompt"] for r in train]
    eval_prompts = [r["prompt"] for r in held_out]
    assert len(set(train_prompts)) == len(train_prompts)
    assert len(set(eval_prompts)) == len(eval_prompts)
    assert not set(train_prompts) & set(eval_prompts)


@pytest.mark.parametrize("name", ALL_TASKS)
def test_deterministic_from_seed(name):
    assert make_task(name, 30, 10, seed=7) == make_task(name, 30, 10, seed=7)
    assert make_task(name, 30, 10, seed=7) != make_task(name, 30, 10, seed=8)


def test_held_out_split_does_not_depend_on_num_train():
    _, small = make_task("addition", 10, 20, seed=0)
    _, large = make_task("addition", 500, 20, seed=0)
    assert small == large


def test_addition_examples():
    train, _ = make_task("addition", 100, 0, seed=0, digits=3)
    for row in train:
        a, b = row["operands"]
        assert row["prompt"] == f"{a}+{b}="
        assert 0 <= a < 1000 and 0 <= b < 1000
    assert max(max(r["operands"]) for r in train) >= 100  # three-digit numbers do appear


def test_reversal_sorting_word_problem_examples():
    row = make_task("reversal", 1, 0, seed=0, min_len=5, max_len=5)[0][0]
    assert row["prompt"] == f"Reverse the letters: {row['word']}" and len(row["word"]) == 5
    row = make_task("sorting", 1, 0, seed=0, count=6, max_value=3)[0][0]
    assert row["prompt"].startswith("Sort ascending: ") and len(row["numbers"]) == 6
    assert all(0 <= n <= 3 for n in row["numbers"])
    rows = make_task("word_problems", 50, 0, seed=0, operations=["sub"])[0]
    assert all(r["operation"] == "sub" and "left?" in r["prompt"] for r in rows)
    assert all(int(r["answer"]) >= 1 for r in rows)


def test_spell_digits_answers_are_long():
    rows = make_task("spell_digits", 200, 0, seed=0)[0]
    assert all(r["prompt"] == f"Spell out the digits: {r['digits']}" and 6 <= len(r["digits"]) <= 8 for r in rows)
    lengths = [len(r["answer"]) for r in rows]  # bytes, so tokens of the byte-level tokenizer
    assert min(lengths) >= 6 * 4 - 1 and sum(lengths) / len(lengths) > 30


def test_unknown_task_lists_choices():
    with pytest.raises(ValueError, match=r"data\.task: unknown task 'adition'") as info:
        make_task("adition", 1, 1, seed=0)
    for name in ALL_TASKS:
        assert name in str(info.value)


def test_unknown_arg_lists_options():
    with pytest.raises(ValueError, match=r"data\.task_args") as info:
        make_task("addition", 1, 1, seed=0, digit=3)
    assert "digit" in str(info.value) and "digits" in str(info.value)
    assert task_arg_names("sorting") == ["count", "max_value"]


@pytest.mark.parametrize(
    "name, args",
    [
        ("addition", {"digits": 0}),
        ("addition", {"digits": "2"}),
        ("reversal", {"min_len": 5, "max_len": 3}),
        ("word_problems", {"operations": ["div"]}),
    ],
)
def test_bad_arg_values(name, args):
    with pytest.raises(ValueError, match=r"data\.task_args\."):
        make_task(name, 1, 1, seed=0, **args)


def test_too_few_distinct_prompts_is_an_error_not_a_hang():
    with pytest.raises(ValueError, match="too few distinct prompts"):
        make_task("addition", num_train=95, num_eval=10, seed=0, digits=1)  # only 100 exist


def test_is_correct_uses_the_tasks_answer_check_else_the_reward_threshold():
    from rlite.tasks import is_correct

    row = {"prompt": "12+35=", "answer": "47", "task": "addition"}
    assert is_correct(" 47<|im_end|>", row, reward=0.0)  # the task's check, whatever the reward
    assert not is_correct("46", row, reward=0.9)  # partial credit is not a right answer
    file_row = {"prompt": "q", "answer": "x"}  # no built-in task: the total reward decides
    assert not is_correct("anything", file_row, reward=0.5)
    assert is_correct("anything", file_row, reward=1.0)
    assert is_correct("anything", file_row, reward=0.5, threshold=0.5)
    assert not is_correct("anything", {**file_row, "task": "my_own_task"}, reward=0.2)
