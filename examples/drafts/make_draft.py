"""Make a speculative draft worth running for a recipe: the recipe's policy cut to its first layer(s),
fitted to the policy's own samples of the recipe's training prompts. Deterministic (seeded, one thread).

    python examples/drafts/make_draft.py configs/quickstart.yaml --out models/quickstart-draft
    rlite train configs/quickstart.yaml rollout.draft=draft_model rollout.draft.args.path=models/quickstart-draft

The prompts are the recipe's own (``data.*``, templated and tokenised as training does) and the samples
are drawn at its ``rollout.temperature`` and ``rollout.max_new_tokens``: the distribution the draft has
to guess during the run. The draft starts from a copy of the policy's embedding, first layer(s), final
norm and output layer (:func:`rlite.drafts.shallow_copy`) and is fitted to those samples
(:func:`rlite.drafts.fit_on_completions`, as ``benchmarks/speculative.py`` fits its draft). At the end the
script measures the acceptance rate of the draft on the held-out prompts (and of the unfitted copy, for
comparison) and prints the ``rlite train`` line that uses it. A random-weight draft is accepted so rarely
that decoding with it is slower than without one.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def sample(engine, prompts: list[list[int]], n: int, temperature: float, max_new_tokens: int, seed: int):
    """``n`` completions per prompt, in batches of 64 prompts: (prompt index, completion) pairs."""
    from rlite.engines.base import SamplingParams

    params = SamplingParams(n=n, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    out = []
    for start in range(0, len(prompts), 64):
        out += [(start + c.prompt_index, c) for c in engine.generate(prompts[start : start + 64], params)]
    return out


def decode_with(policy, draft, tokenizer, prompts: list[list[int]], n: int, temperature: float, max_new_tokens: int,
                k: int) -> dict[str, float]:  # fmt: skip
    """Decode ``n`` samples of each of ``prompts`` with ``draft`` (None: plain decoding), in batches of 64
    prompts: the acceptance rate (accepted / proposed draft tokens) and the CPU seconds it took (the
    smallest of 3 passes: CPU time, not wall time, so that other work on the machine does not count)."""
    from rlite.engines.base import DraftSpec, SamplingParams, SpeculationStats
    from rlite.plugins.transformers.engine import TransformersEngine

    speculative = {} if draft is None else {"draft": DraftSpec("model", k, model_path="in-memory"), "draft_model": draft}
    engine = TransformersEngine(policy, pad_token_id=tokenizer.pad_token_id, eos_token_ids=[tokenizer.eos_token_id],
                                **speculative)  # fmt: skip
    params = SamplingParams(n=n, max_new_tokens=max_new_tokens, temperature=temperature, seed=0)
    engine.generate(prompts[:4], params)  # the first call pays one-off costs
    passes, total = [], SpeculationStats()
    for _ in range(3):
        started = time.process_time()
        for start in range(0, len(prompts), 64):
            engine.generate(prompts[start : start + 64], params)
            total = total + (engine.speculation_stats() if draft is not None else SpeculationStats())
        passes.append(time.process_time() - started)
    return {"acceptance": total.accepted / max(total.proposed, 1), "cpu_s": min(passes)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="the recipe (YAML): its model.path is the policy, its data the prompts")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, as for rlite train")
    parser.add_argument("--out", required=True, type=Path, help="the draft's folder (a Hugging Face model folder)")
    parser.add_argument("--layers", type=int, default=1, help="the draft's layers (default 1)")
    parser.add_argument("--prompts", type=int, default=1000, help="training prompts sampled (default 1000)")
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt (default 4)")
    parser.add_argument("--steps", type=int, default=300, help="fitting steps of 64 completions (default 300)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate of the fit (default 3e-3)")
    parser.add_argument("--k", type=int, default=4, help="proposals per verification when measuring (default 4)")
    parser.add_argument("--measure-prompts", type=int, default=64,
                        help="held-out prompts decoded (x rollout.samples_per_prompt) to measure the draft (default 64)")
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from rlite.config import load_config
    from rlite.data import load_prompt_splits
    from rlite.drafts import fit_on_completions, shallow_copy
    from rlite.plugins.transformers.engine import TransformersEngine

    hf_logging.disable_progress_bar()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = load_config(args.config, args.overrides, pm=False)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer or cfg.model.path)
    policy = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32).eval()
    train_prompts, eval_prompts = load_prompt_splits(cfg.data, tokenizer)
    prompts = [item.prompt_ids for item in train_prompts.items[: args.prompts]]
    temperature, max_new_tokens = cfg.rollout.temperature, cfg.rollout.max_new_tokens

    print(f"sampling {args.samples} completions of {len(prompts)} training prompts from {cfg.model.path} "
          f"(temperature {temperature}, at most {max_new_tokens} tokens)", flush=True)  # fmt: skip
    engine = TransformersEngine(policy, pad_token_id=tokenizer.pad_token_id, eos_token_ids=[tokenizer.eos_token_id])
    completions = sample(engine, prompts, args.samples, temperature, max_new_tokens, seed=1)
    examples = [(prompts[i], list(c.token_ids)) for i, c in completions]

    draft = shallow_copy(policy, args.layers)
    start = shallow_copy(policy, args.layers).eval()
    print(f"fitting a {args.layers}-layer copy of the policy to them: {args.steps} steps", flush=True)
    fit_on_completions(draft, examples, args.steps, tokenizer.pad_token_id, lr=args.lr, seed=1, every=50,
                       report=lambda line: print(line, flush=True))  # fmt: skip
    draft.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)

    held_out = [item.prompt_ids for item in (eval_prompts or train_prompts).items[: args.measure_prompts]]
    n = cfg.rollout.samples_per_prompt
    measured = {name: decode_with(policy, model, tokenizer, held_out, n, temperature, max_new_tokens, args.k)
                for name, model in (("no_draft", None), ("fitted", draft), ("unfitted_copy", start))}  # fmt: skip
    speedup = measured["no_draft"]["cpu_s"] / measured["fitted"]["cpu_s"]
    (args.out / "draft_fit.json").write_text(json.dumps({
        "config": str(args.config), "policy": str(cfg.model.path), "layers": args.layers, "prompts": len(prompts),
        "samples": args.samples, "steps": args.steps, "k": args.k, "held_out_prompts": len(held_out),
        "measured": measured, "cpu_speedup": speedup,
    }, indent=2) + "\n")  # fmt: skip
    print(f"draft written to {args.out}")
    verdict = (f"decoding with it took {speedup:.2f}x less CPU time than without a draft" if speedup >= 1 else
               f"decoding with it took {1 / speedup:.2f}x MORE CPU time than without a draft: on this machine the "
               "recipe decodes faster with no draft")  # fmt: skip
    print(f"on {len(held_out)} held-out prompts x {n} samples, k={args.k}: acceptance "
          f"{measured['fitted']['acceptance']:.3f} (the unfitted copy: {measured['unfitted_copy']['acceptance']:.3f}); "
          f"{verdict}")  # fmt: skip
    print(f"use it: rlite train {args.config} rollout.draft=draft_model rollout.draft.args.path={args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
