"""The least memory full fp32 fine-tuning with AdamW can take, measured: what a run holds before
its first activation.

Loads what every rlite run loads (torch, transformers, rlite, the tokenizer, the model), then creates
the gradients and AdamW's two moments exactly as a training step does (one fused AdamW step at
learning rate 0 on zero gradients), and prints the process's resident memory after each stage. No
activation, KV cache or engine is counted, so a real run's peak RSS can only be higher. Used for
issue 7's memory target (a third of TRL's peak RSS on the SmolLM2 job); see benchmarks/RESULTS.md.

    python benchmarks/memory_floor.py --model-dir ~/.cache/rlite-bench/smollm2-135m-instruct-fp32 \\
        --compare-gib 7.30
"""

from __future__ import annotations

import argparse
import os

from machine_info import rss_mib  # benchmarks/ is on sys.path when a script here runs


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=os.path.expanduser("~/.cache/rlite-bench/smollm2-135m-instruct-fp32"))
    parser.add_argument("--compare-gib", type=float, default=None, help="another run's peak RSS, e.g. TRL's")
    args = parser.parse_args(argv)
    rows = [("python", rss_mib())]
    import torch

    torch.set_num_threads(1)
    rows.append(("+ import torch", rss_mib()))
    import transformers  # noqa: F401

    import rlite.run.loop  # noqa: F401

    rows.append(("+ import transformers, rlite", rss_mib()))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoTokenizer.from_pretrained(args.model_dir)
    rows.append(("+ tokenizer", rss_mib()))
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.data.add_(0)  # touch every page (safetensors may map the file lazily)
    n = sum(p.numel() for p in params)
    rows.append((f"+ fp32 weights ({n / 1e6:.1f}M parameters)", rss_mib()))
    for p in params:
        p.grad = torch.zeros_like(p)
    rows.append(("+ fp32 gradients", rss_mib()))
    optimizer = torch.optim.AdamW(params, lr=0.0, fused=True)
    optimizer.step()
    rows.append(("+ AdamW moments (fp32 exp_avg, exp_avg_sq)", rss_mib()))
    print("| stage | RSS, MiB | RSS, GiB |\n|---|---:|---:|")
    for name, mib in rows:
        print(f"| {name} | {mib:.0f} | {mib / 1024:.2f} |")
    floor = rows[-1][1] / 1024
    print(f"\nfloor before any activation: {floor:.2f} GiB (16 bytes per parameter = {16 * n / 2**30:.2f} GiB of it)")
    if args.compare_gib:
        print(f"a third of {args.compare_gib:.2f} GiB is {args.compare_gib / 3:.2f} GiB: the floor is "
              f"{floor / args.compare_gib:.2f}x the compared peak")


if __name__ == "__main__":
    main()
