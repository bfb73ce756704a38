"""The reward of examples/own_data, loaded by file path from config.yaml:

    rewards:
      - {name: python, args: {function: examples/own_data/reward.py:correct}}

rlite calls ``correct(completion, sample)`` once per sampled completion, in a worker process: the
decoded completion text, and ``sample``, the data row as read from the jsonl file plus ``prompt`` and
``answer`` (the values of ``data.prompt_key`` and ``data.answer_key``, whatever the columns are
called), ``response_length`` (tokens) and ``finish_reason``. The nested column is there as it was in
the file (``sample["reward_model"]["ground_truth"]``), so a reward may read any column.
"""

END_OF_TURN = "<|im_end|>"
"""The chat template's end-of-turn text; the decoded completion may still hold it."""


def correct(completion: str, sample: dict) -> float:
    """1.0 when the completion, cut at the end-of-turn text and stripped, is the row's answer; else 0.0."""
    answer = completion.split(END_OF_TURN)[0].strip()
    return 1.0 if answer == str(sample["answer"]) else 0.0
