"""Does a single-turn warm start still add when something stands before the problem? (docs/multiturn.md, 2a)

Greedy accuracy of a model (default: the quickstart's warm start) on the quickstart task's 256 held-out
2-digit additions (``make_task("addition", 2000, 256, 0, digits=2)``'s eval split), each asked through the
model's chat template in five contexts:

- ``alone``: the problem as the only user message (what the quickstart trains on);
- ``after_right``: after an earlier exchange, the previous held-out problem and its right answer, as in
  ``arithmetic_chain``'s second turn;
- ``after_wrong``: the same with a wrong answer (the right one plus 1);
- ``after_user``: after another user message (the previous problem, unanswered);
- ``after_system``: after a system message (``You are a helpful assistant.``).

Replies are scored by the task's answer check (:func:`rlite.tasks.is_correct`).

    python benchmarks/multiturn_contexts.py [--model examples/warmstart/addition-qwen2-1m]
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlite.tasks import is_correct, make_task


def contexts(row: dict, previous: dict) -> dict[str, list[dict[str, str]]]:
    ask = {"role": "user", "content": row["prompt"]}
    earlier = {"role": "user", "content": previous["prompt"]}
    return {
        "alone": [ask],
        "after_right": [earlier, {"role": "assistant", "content": previous["answer"]}, ask],
        "after_wrong": [earlier, {"role": "assistant", "content": str(int(previous["answer"]) + 1)}, ask],
        "after_user": [earlier, ask],
        "after_system": [{"role": "system", "content": "You are a helpful assistant."}, ask],
    }


@torch.no_grad()
def greedy(model, tokenizer, conversations: list[list[dict[str, str]]], max_new_tokens: int = 8) -> list[str]:
    texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="examples/warmstart/addition-qwen2-1m")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    _, held_out = make_task("addition", 2000, 256, 0, digits=2)
    rows = [(row, held_out[i - 1]) for i, row in enumerate(held_out)]  # the first row's "previous" is the last
    print(f"{args.model}, greedy, {len(rows)} held-out 2-digit additions")
    for name in contexts(*rows[0]):
        replies = greedy(model, tokenizer, [contexts(row, previous)[name] for row, previous in rows])
        right = sum(is_correct(reply, row, 0.0) for reply, (row, _) in zip(replies, rows))
        print(f"  {name:13s} {right / len(rows):.3f} ({right}/{len(rows)})")


if __name__ == "__main__":
    main()
