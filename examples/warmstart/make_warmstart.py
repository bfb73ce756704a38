"""Build the quickstart's starting model: a ~1M-parameter Qwen2 that is partly competent at
2-digit addition, made by a few hundred plain supervised steps. Deterministic (seeded, one thread,
and the same CPU kernels on any x86-64 machine: ``DETERMINISTIC_ENV`` below): re-running it rewrites the
same weights, and the SHA-256 of the tensors it prints is recorded, for each warm start and for a
3-step run, in ``examples/warmstart/HASHES.json`` (``tests/integration/test_warmstart_script.py``
checks both). Bit for bit needs the same torch and transformers (torch 2.13.0+cpu, transformers 5.24.0
wrote the recorded weights) on an x86-64 CPU with AVX2; another torch, transformers or an ARM CPU
writes other weights of the same quality.

    python examples/warmstart/make_warmstart.py               # examples/warmstart/addition-qwen2-1m
    python examples/warmstart/make_warmstart.py --moe         # examples/warmstart/addition-qwen3moe (MoE recipe)
    python examples/warmstart/make_warmstart.py --multiturn   # examples/warmstart/multiturn-qwen2-1m
    python examples/warmstart/make_warmstart.py --strings     # examples/warmstart/strings-qwen2-1m

``--multiturn`` trains the same Qwen2 on chat conversations instead of single prompts, for the
multi-turn recipes (configs/multiturn_*.yaml): the quickstart model answers a prompt only when it is
the whole conversation (with any earlier turn in front, the held-out accuracy of its 2026-11-22 version
dropped from 0.33 to 0.00; docs/multiturn.md). A conversation is one to three additions in a row, each a user message answered by
the assistant (the ``arithmetic_chain`` game), or, one time in three, a calculator call: the assistant
repeats the problem, a ``tool`` message answers it, the assistant copies the answer (the ``calculator``
environment's protocol). The loss is on the assistant's messages only. The model is shipped.

``--strings`` trains the same Qwen2 on short string instructions instead of sums, for tasks of your own
that are about text rather than digits (examples/own_task: reversing words): ``copy: abc`` -> ``abc``,
``upper: abc`` -> ``ABC``, ``reverse: abc`` -> ``cba``, ``first: abc`` -> ``a``, ``last: abc`` -> ``c``, on
words of 3-5 random lowercase letters (the tokenizer is byte-level, so a letter is a token). It is
partly right at reversing unseen words, so RL on a reversing task has a signal from the first step.
Its held-out words are drawn apart from its training words; examples/own_task draws its own. Shipped.

``--moe`` makes a Qwen3-MoE instead (4 experts, top-2, every layer sparse) for
``configs/moe_megatron_cpu.yaml``; it is not shipped, run the command once to make it.

Supervised steps only see the *training* split of the task (``data.seed=0``), never the held-out
prompts that the quickstart evaluates on.
"""

from __future__ import annotations

import argparse
import hashlib
import os
from pathlib import Path

# The same weights on every x86-64 machine: these are read when torch loads, so they are set before it is
# imported (a caller's values are overridden: other values write other weights). Without them the weights
# depend on the CPU: MKL picks its matmul kernels by vendor (AVX-512 ones on Intel, AVX2 on AMD) and ATen its
# vector kernels by the widest instruction set present (AVX-512 or AVX2), and each choice sums in its own
# order; 600 steps turn those last-bit differences into other weights (another held-out accuracy).
DETERMINISTIC_ENV = {
    "MKL_CBWR": "COMPATIBLE",  # MKL's conditional numerical reproducibility: one code path on any x86-64 CPU
    "ATEN_CPU_CAPABILITY": "avx2",  # ATen's AVX2 kernels, present on every x86-64 CPU since 2013-2015
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
if __name__ == "__main__":  # run as the documented command; a test importing this module leaves its environment as it is
    os.environ.update(DETERMINISTIC_ENV)

import torch  # noqa: E402

from rlite.data import format_prompt  # noqa: E402
from rlite.tasks import make_task  # noqa: E402
from rlite.tokenizer import build_byte_tokenizer  # noqa: E402

HERE = Path(__file__).parent

DEFAULT_STEPS = {"addition-qwen2-1m": 390, "multiturn-qwen2-1m": 600, "addition-qwen3moe": 400, "strings-qwen2-1m": 500}
"""Supervised steps of each warm start (named by its folder) when ``--steps`` is not given."""


def warm_start_name(moe: bool, multiturn: bool, strings: bool = False) -> str:
    if strings:
        return "strings-qwen2-1m"
    return "addition-qwen3moe" if moe else "multiturn-qwen2-1m" if multiturn else "addition-qwen2-1m"


STRING_TASKS = {
    "copy": lambda word: word,
    "upper": str.upper,
    "reverse": lambda word: word[::-1],
    "first": lambda word: word[0],
    "last": lambda word: word[-1],
}
"""The instructions of ``--strings``: ``f"{name}: {word}"`` is answered by ``STRING_TASKS[name](word)``."""


def random_word(rng) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 5)))


def string_rows(num_train: int, num_eval: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """``--strings``' supervised rows (every task, on distinct words) and its held-out rows: ``reverse``
    on words none of the training rows uses, the skill examples/own_task trains further with RL."""
    import random

    rng = random.Random(f"strings:{seed}")
    eval_words: set[str] = set()
    while len(eval_words) < num_eval:
        eval_words.add(random_word(rng))
    train = []
    while len(train) < num_train:
        word = random_word(rng)
        if word not in eval_words:
            task = rng.choice(sorted(STRING_TASKS))
            train.append({"prompt": f"{task}: {word}", "answer": STRING_TASKS[task](word)})
    held_out = [{"prompt": f"reverse: {w}", "answer": w[::-1]} for w in sorted(eval_words)]
    return train, held_out


def tensors_sha256(model_dir: str | Path) -> str:
    """SHA-256 over a saved model's tensors (name, dtype, shape and bytes, in name order): what
    ``HASHES.json`` records. Unlike the file's own hash it ignores how safetensors lays the file out."""
    from safetensors.torch import load_file

    digest = hashlib.sha256()
    for name, tensor in sorted(load_file(Path(model_dir) / "model.safetensors").items()):
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def build_moe_model(tokenizer):
    from transformers import GenerationConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=128,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.02)  # transformers leaves the router at zero: ties everywhere
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return model


def build_model(tokenizer):
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return model


def encode(tokenizer, rows):
    """Prompt ids (chat template) + answer ids + eos; loss only on the answer and eos."""
    examples = []
    for row in rows:
        prompt = tokenizer(format_prompt(row["prompt"], tokenizer, True), add_special_tokens=False)["input_ids"]
        answer = tokenizer(row["answer"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        examples.append((prompt, answer))
    return examples


def encode_conversations(tokenizer, rows, seed: int = 0):
    """Chat conversations built on the training rows (``--multiturn``): ids and the loss mask (1 on the
    assistant's messages and their end token), one conversation per row (the row's problem first)."""
    import random

    rng = random.Random(seed)

    def piece(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    examples = []
    for row in rows:
        if rng.random() < 1 / 3:  # a calculator call: the problem, the tool's answer, the answer copied
            turns = [("user", row["prompt"]), ("assistant", row["prompt"]), ("tool", row["answer"]),
                     ("assistant", row["answer"])]  # fmt: skip
        else:  # one to three problems in a row
            turns = []
            for other in [row] + [rows[rng.randrange(len(rows))] for _ in range(rng.randrange(3))]:
                turns += [("user", other["prompt"]), ("assistant", other["answer"])]
        ids, mask = [], []
        for role, content in turns:
            head = piece(f"<|im_start|>{role}\n")
            body = piece(content) + [tokenizer.eos_token_id]  # eos is <|im_end|>, the turn's end
            tail = piece("\n")
            trained = int(role == "assistant")
            ids += head + body + tail
            mask += [0] * len(head) + [trained] * len(body) + [0] * len(tail)
        examples.append((ids, mask))
    return examples


def collate_conversations(examples, pad_id):
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id)
    labels = torch.full((len(examples), width), -100)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (seq, trained) in enumerate(examples):
        ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, : len(seq)] = torch.where(torch.tensor(trained, dtype=torch.bool), torch.tensor(seq), -100)
        mask[i, : len(seq)] = 1
    return ids, labels, mask


def collate(examples, pad_id):
    width = max(len(p) + len(a) for p, a in examples)
    ids = torch.full((len(examples), width), pad_id)
    labels = torch.full((len(examples), width), -100)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (p, a) in enumerate(examples):
        seq = p + a
        ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, len(p) : len(seq)] = torch.tensor(a)
        mask[i, : len(seq)] = 1
    return ids, labels, mask


@torch.no_grad()
def greedy_accuracy(model, tokenizer, rows) -> float:
    from rlite.engines.base import SamplingParams
    from rlite.plugins.transformers.engine import TransformersEngine

    engine = TransformersEngine(model, pad_token_id=tokenizer.pad_token_id, eos_token_ids=[tokenizer.eos_token_id])
    prompts = [p for p, _ in encode(tokenizer, rows)]
    out = engine.generate(prompts, SamplingParams(n=1, max_new_tokens=8, greedy=True, seed=0))
    texts = tokenizer.batch_decode([c.token_ids for c in out], skip_special_tokens=True)
    for p in model.parameters():
        p.requires_grad_(True)
    return sum(t.strip() == r["answer"] for t, r in zip(texts, rows)) / len(rows)


@torch.no_grad()
def chain_accuracy(model, tokenizer, rows, steps: int = 3) -> list[float]:
    """Greedy accuracy of each turn of the ``arithmetic_chain`` game on the held-out prompts."""
    from rlite.engines.base import SamplingParams
    from rlite.plugins.transformers.engine import TransformersEngine
    from rlite.plugins.workflows import ArithmeticChain, ArithmeticChainConfig
    from rlite.workflows import TurnRunner, turn_format

    engine = TransformersEngine(model, pad_token_id=tokenizer.pad_token_id, eos_token_ids=[tokenizer.eos_token_id])
    runner = TurnRunner(lambda: ArithmeticChain(ArithmeticChainConfig(steps=steps)), tokenizer,
                        turn_format(tokenizer, "user", True, [tokenizer.eos_token_id]), max_turns=steps,
                        max_response_tokens=64)  # fmt: skip
    prompts = [p for p, _ in encode(tokenizer, rows)]
    trajectories = runner.run(engine, prompts, rows, SamplingParams(n=1, max_new_tokens=6, greedy=True, seed=0),
                              lambda turn: turn)  # fmt: skip
    for p in model.parameters():
        p.requires_grad_(True)
    return [round(sum(t.metrics[f"turn_{i}_correct"] for t in trajectories) / len(rows), 3) for i in range(steps)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--moe", action="store_true", help="a Qwen3-MoE (4 experts, top-2) instead of the dense Qwen2")
    parser.add_argument("--multiturn", action="store_true", help="train on chat conversations (multi-turn recipes)")
    parser.add_argument("--strings", action="store_true", help="train on string instructions (copy, upper, reverse, ...)")
    defaults = ", ".join(f"{steps} for {name}" for name, steps in DEFAULT_STEPS.items())
    parser.add_argument("--steps", type=int, default=None, help=f"supervised steps (default: {defaults})")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval-every", type=int, default=0)
    parser.add_argument("--save-at", default="", help="also save the model after these steps (comma-separated) "
                        "to OUT-step<N>: the same weights as --steps N, for choosing --steps in one run")
    args = parser.parse_args()
    if args.moe + args.multiturn + args.strings > 1:
        parser.error("--moe, --multiturn and --strings make different warm starts: give one of them")
    name = warm_start_name(args.moe, args.multiturn, args.strings)
    if args.steps is None:
        args.steps = DEFAULT_STEPS[name]
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")

    torch.set_num_threads(1)
    torch.manual_seed(0)
    tokenizer = build_byte_tokenizer()
    if args.strings:
        train_rows, eval_rows = string_rows(num_train=4000, num_eval=256)
    else:
        train_rows, eval_rows = make_task("addition", num_train=2000, num_eval=256, seed=0, digits=2)
    examples = encode_conversations(tokenizer, train_rows) if args.multiturn else encode(tokenizer, train_rows)
    batch_of = collate_conversations if args.multiturn else collate
    model = build_moe_model(tokenizer) if args.moe else build_model(tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(0)
    model.train()
    for step in range(1, args.steps + 1):
        index = torch.randint(len(examples), (args.batch,), generator=generator).tolist()
        ids, labels, mask = batch_of([examples[i] for i in index], tokenizer.pad_token_id)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if str(step) in args.save_at.split(","):
            snapshot = Path(f"{args.out or HERE / name}-step{step}")
            model.save_pretrained(snapshot)
            tokenizer.save_pretrained(snapshot)
        if args.eval_every and step % args.eval_every == 0:
            chain = f", per chain turn {chain_accuracy(model, tokenizer, eval_rows)}" if args.multiturn else ""
            accuracy = greedy_accuracy(model, tokenizer, eval_rows)
            print(f"step {step} loss {loss.item():.3f} held-out greedy acc {accuracy:.3f}{chain}")
    model.eval()
    print(f"final held-out greedy accuracy: {greedy_accuracy(model, tokenizer, eval_rows):.3f}")
    if args.multiturn:
        print(f"held-out greedy accuracy per turn of a three-problem chain: {chain_accuracy(model, tokenizer, eval_rows)}")
    out = Path(args.out or HERE / name)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"saved {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters to {out}")
    print(f"tensors sha256: {tensors_sha256(out)}")


if __name__ == "__main__":
    main()
