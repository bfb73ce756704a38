"""The reward of examples/own_task, loaded by file path from config.yaml:

    rewards:
      - {name: python, args: {function: examples/own_task/reward.py:reversed_word}}

rlite calls ``reversed_word(completion, sample)`` once per sampled completion, in a worker process:
``completion`` is the decoded text, ``sample`` the data row (every column of the jsonl file) plus
``prompt`` and ``answer`` (the values under ``data.prompt_key`` and ``data.answer_key``),
``response_length`` and ``finish_reason``.
"""

END_OF_TURN = "<|im_end|>"
"""The chat template's end-of-turn text; the decoded completion may still hold it."""


def reversed_word(completion: str, sample: dict) -> float:
    """1.0 for the word reversed exactly; else half a point times the fraction of letters in their right
    place (over the longer of the two strings, so extra letters cost), so that a nearly right answer
    scores above a wrong one and GRPO has a signal while exact answers are still rare."""
    written = completion.split(END_OF_TURN)[0].strip()
    target = sample["answer"]
    if written == target:
        return 1.0
    in_place = sum(a == b for a, b in zip(written, target))
    return 0.5 * in_place / max(len(written), len(target), 1)
