"""The samples table TensorBoard shows (and W&B's, which takes every column) has the templated prompt."""

from __future__ import annotations

from rlite.samples import samples_markdown


def test_the_markdown_table_shows_the_text_the_model_saw_after_the_raw_prompt():
    rows = [{"group": 0, "prompt": "1+1=", "prompt_text": "<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n",
             "answer": "2", "completion": "2", "reward": 1.0}]  # fmt: skip
    header, _, row = samples_markdown(rows).splitlines()
    assert header == "| group | prompt | prompt_text | answer | completion | reward |"
    assert "| 1+1= | <\\|im_start\\|>user<br>1+1=<\\|im_end\\|><br><\\|im_start\\|>assistant<br> |" in row
