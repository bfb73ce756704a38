"""Built-in synthetic tasks: verifiable prompts generated deterministically from a seed.

Each task is a function ``task(rng, **args) -> row`` that draws one row ``{"prompt", "answer", ...}``
from ``rng`` (a :class:`random.Random`). Extra keys are metadata (the task name and the operands), the
same keys in every row of a task. :func:`make_task` draws rows until it has enough *distinct*
prompts and returns a training split and a held-out split that share no prompt.

The held-out split comes from its own random stream, so it depends only on ``(task, args, seed,
num_eval)``, not on ``num_train``: growing the training set never changes what is evaluated.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable
from typing import Any

TaskFn = Callable[..., dict[str, Any]]


def _arg_error(name: str, message: str) -> ValueError:
    return ValueError(f"data.task_args.{name}: {message}")


def _check_int(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _arg_error(name, f"must be an integer in [{low}, {high}], got {value!r}")
    return value


# --------------------------------------------------------------------------------------------------
# tasks
# --------------------------------------------------------------------------------------------------


def addition(rng: random.Random, digits: int = 2) -> dict[str, Any]:
    """``"12+35="`` -> ``"47"``: the sum of two numbers of up to ``digits`` digits."""
    _check_int("digits", digits, 1, 18)
    a, b = rng.randrange(10**digits), rng.randrange(10**digits)
    return {"prompt": f"{a}+{b}=", "answer": str(a + b), "task": "addition", "operands": [a, b]}


LETTERS = "abcdefghijklmnopqrstuvwxyz"


def reversal(rng: random.Random, min_len: int = 3, max_len: int = 6) -> dict[str, Any]:
    """``"Reverse the letters: kqzt"`` -> ``"tzqk"``, for random lowercase words of ``min_len``-``max_len`` letters."""
    _check_int("min_len", min_len, 1, 64)
    _check_int("max_len", max_len, min_len, 64)
    word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(min_len, max_len)))
    return {"prompt": f"Reverse the letters: {word}", "answer": word[::-1], "task": "reversal", "word": word}


def sorting(rng: random.Random, count: int = 4, max_value: int = 9) -> dict[str, Any]:
    """``"Sort ascending: 3 1 4 1"`` -> ``"1 1 3 4"``, for ``count`` integers in ``[0, max_value]``."""
    _check_int("count", count, 2, 64)
    _check_int("max_value", max_value, 1, 10**9)
    numbers = [rng.randint(0, max_value) for _ in range(count)]
    return {
        "prompt": "Sort ascending: " + " ".join(map(str, numbers)),
        "answer": " ".join(map(str, sorted(numbers))),
        "task": "sorting",
        "numbers": numbers,
    }


NAMES = [("Tom", "he"), ("Mia", "she"), ("Sam", "he"), ("Ana", "she"), ("Leo", "he"), ("Zoe", "she")]
ITEMS = ["apples", "pencils", "marbles", "stickers", "cookies", "books", "coins", "shells"]
OPERATIONS = ("add", "sub", "mul")


def word_problems(
    rng: random.Random, max_value: int = 10, operations: list[str] | tuple[str, ...] = OPERATIONS
) -> dict[str, Any]:
    """One-step arithmetic stories; the answer is a non-negative integer.

    ``add``: "Tom has 3 apples and buys 4 more. How many apples does he have?" -> "7";
    ``sub``: "... gives 4 away. How many ... left?"; ``mul``: "There are 3 boxes with 4 ... each. ...".
    Operands are at most ``max_value``.
    """
    _check_int("max_value", max_value, 2, 10**6)
    ops = list(operations)
    unknown = sorted(set(ops) - set(OPERATIONS))
    if not ops or unknown:
        raise _arg_error("operations", f"must be a non-empty list of {', '.join(OPERATIONS)}; got {ops!r}")
    op = rng.choice(ops)
    name, pronoun = rng.choice(NAMES)
    item = rng.choice(ITEMS)
    a = rng.randint(2, max_value)  # at least 2 so that the plural item names read right
    if op == "add":
        b = rng.randint(1, max_value)
        prompt = f"{name} has {a} {item} and buys {b} more. How many {item} does {pronoun} have?"
        answer = a + b
    elif op == "sub":
        b = rng.randint(1, a - 1)
        prompt = f"{name} has {a} {item} and gives {b} to a friend. How many {item} does {pronoun} have left?"
        answer = a - b
    else:
        b = rng.randint(2, max_value)
        prompt = f"There are {a} boxes with {b} {item} in each box. How many {item} are there in total?"
        answer = a * b
    return {
        "prompt": prompt,
        "answer": str(answer),
        "task": "word_problems",
        "operation": op,
        "operands": [a, b],
    }


DIGIT_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def spell_digits(rng: random.Random, min_digits: int = 6, max_digits: int = 8) -> dict[str, Any]:
    """``"Spell out the digits: 40712"`` -> ``"four zero seven one two"``: a long, structured answer
    (about 5 characters, so 5 byte tokens, per digit: 30-40 tokens with the defaults), whose first
    letter of each word is the only hard choice. Made for measuring speculative decoding."""
    _check_int("min_digits", min_digits, 1, 64)
    _check_int("max_digits", max_digits, min_digits, 64)
    digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(min_digits, max_digits)))
    return {
        "prompt": f"Spell out the digits: {digits}",
        "answer": " ".join(DIGIT_NAMES[int(d)] for d in digits),
        "task": "spell_digits",
        "digits": digits,
    }


def python_expression(rng: random.Random, digits: int = 2) -> dict[str, Any]:
    """``"x=12+35="`` -> a Python expression whose value is 47 (``47``, ``12+35``, ``50-3``): the
    completion is run in the sandbox as ``print(<completion>)`` by the ``code_exec`` reward against
    the row's ``tests`` (one case: empty stdin, stdout ``47``). Made for the code-execution recipe
    (``configs/code_exec.yaml``): the addition warm start knows the digits, not this prompt."""
    _check_int("digits", digits, 1, 18)
    a, b = rng.randrange(10**digits), rng.randrange(10**digits)
    return {
        "prompt": f"x={a}+{b}=",
        "answer": str(a + b),
        "task": "python_expression",
        "operands": [a, b],
        "tests": [{"stdin": "", "stdout": str(a + b)}],
    }


TASKS: dict[str, TaskFn] = {
    "addition": addition,
    "reversal": reversal,
    "sorting": sorting,
    "word_problems": word_problems,
    "spell_digits": spell_digits,
    "python_expression": python_expression,
}
"""Built-in synthetic tasks by name (``data.task``)."""


# --------------------------------------------------------------------------------------------------
# answer checks: what "correct" means for accuracy metrics
# --------------------------------------------------------------------------------------------------

END_OF_TURN_TEXTS = ("<|im_end|>", "<|endoftext|>", "</s>")
"""End-of-turn texts a decoded completion may still hold; the answer check ignores everything from the first."""


def exact_answer(completion: str, answer: Any) -> bool:
    """The completion, cut at the first end-of-turn text and stripped, equals the answer string."""
    for end in END_OF_TURN_TEXTS:
        completion = completion.split(end, 1)[0]
    return completion.strip() == str(answer).strip()


TASK_CHECKS: dict[str, Callable[[str, Any], bool]] = {name: exact_answer for name in TASKS if name != "python_expression"}
"""Answer check of each built-in task: ``check(completion, answer) -> bool``. These tasks' answers are
one canonical string (a number, a word, a list of digits or words), so each checks equality;
``python_expression`` has many right answers (any expression of the value), judged by its reward."""

DEFAULT_ACCURACY_THRESHOLD = 1.0


def is_correct(completion: str, sample: dict[str, Any], reward: float, threshold: float = DEFAULT_ACCURACY_THRESHOLD) -> bool:
    """Whether a completion answers its prompt correctly, for the ``*accuracy`` metrics.

    A row of a built-in task (its ``task`` column names one) is judged by the task's answer check,
    whatever the rewards are (shaped or partial-credit rewards do not make a wrong answer right);
    any other row by its total reward: correct when ``reward >= threshold``
    (``training.accuracy_threshold``).
    """
    check = TASK_CHECKS.get(sample.get("task")) if isinstance(sample.get("task"), str) else None
    if check is not None and "answer" in sample:
        return bool(check(completion, sample["answer"]))
    return reward >= threshold


# --------------------------------------------------------------------------------------------------
# splits
# --------------------------------------------------------------------------------------------------


def task_arg_names(name: str) -> list[str]:
    """The options a task accepts in ``data.task_args``."""
    params = list(inspect.signature(TASKS[name]).parameters.values())[1:]  # skip rng
    return [p.name for p in params]


def _check_task(name: str, args: dict[str, Any]) -> TaskFn:
    if name not in TASKS:
        raise ValueError(f"data.task: unknown task {name!r}. Valid choices: {', '.join(sorted(TASKS))}.")
    valid = task_arg_names(name)
    unknown = sorted(set(args) - set(valid))
    if unknown:
        raise ValueError(
            f"data.task_args: task {name!r} has no option(s) {', '.join(unknown)}. "
            f"Valid options: {', '.join(valid) if valid else '(none)'}."
        )
    return TASKS[name]


def _draw_distinct(
    task: TaskFn, rng: random.Random, count: int, args: dict[str, Any], exclude: set[str], what: str
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    seen = set(exclude)
    misses = 0
    # A task whose prompt space is nearly exhausted keeps drawing duplicates; give up loudly instead
    # of looping for ever.
    max_misses = 1000 + 20 * count
    while len(rows) < count:
        row = task(rng, **args)
        if row["prompt"] in seen:
            misses += 1
            if misses > max_misses:
                raise ValueError(
                    f"data.task_args: task {row.get('task', '?')!r} with args {args} has too few distinct "
                    f"prompts for {what} ({len(rows)} of {count} found); lower data.num_train/data.num_eval "
                    "or widen the task (for example more digits)"
                )
            continue
        seen.add(row["prompt"])
        rows.append(row)
    return rows


def make_task(
    name: str, num_train: int, num_eval: int, seed: int, **args: Any
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Generate ``(train_rows, eval_rows)`` of a built-in task; no prompt appears in both.

    Rows are a pure function of the arguments. Within each split prompts are distinct. Raises
    ``ValueError`` naming ``data.task``/``data.task_args`` for an unknown task or option, a bad option
    value, or a task too small for the requested sizes.
    """
    task = _check_task(name, args)
    if num_train < 0 or num_eval < 0:
        raise ValueError(f"data.num_train and data.num_eval must be >= 0, got {num_train} and {num_eval}")
    eval_rng = random.Random(f"rlite.tasks:{name}:{seed}:eval")
    train_rng = random.Random(f"rlite.tasks:{name}:{seed}:train")
    eval_rows = _draw_distinct(task, eval_rng, num_eval, args, set(), "the held-out split")
    held_out = {row["prompt"] for row in eval_rows}
    train_rows = _draw_distinct(task, train_rng, num_train, args, held_out, "the training split")
    return train_rows, eval_rows
