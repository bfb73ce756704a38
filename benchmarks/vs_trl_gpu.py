"""The ``gpu`` and ``gpu-tiny`` jobs of ``vs_trl.py``: rlite (its defaults) against TRL 1.16's ``GRPOTrainer``
on one GPU, in two precisions, each framework in its own process.

**gpu**: a randomly initialised ``Qwen2ForCausalLM`` of Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14
heads, 2 KV heads, intermediate 4864, tied embeddings, vocabulary 151,936, 494M parameters), built here
with ``rlite.tokenizer.build_tiny_model_dir`` and rlite's byte tokenizer (no download); 16 prompts of 205
templated tokens x 8 completions of exactly 256 new tokens (EOS ignored: rlite ``rollout.ignore_eos=true``,
TRL ``min_new_tokens=256``), temperature 1, reward: the share of digits in the completion (the same
function in both), no KL, AdamW lr 1e-6 constant, clip 1.0, one optimizer step per batch, micro-batch 32
(TRL: 32 x 4 accumulated), sdpa. Precisions: ``bf16`` (parameters, gradients and AdamW state in bf16;
TRL: the model loaded in bf16) and ``fp32-master`` (float32 masters, bf16 compute; TRL: float32 under
bf16 autocast). rlite runs with its defaults for everything else: the point is a GPU default nobody has
to tune.

**gpu-tiny**: the same job shrunk to run on a CPU in about a minute a process (hidden 64, 2 layers,
vocabulary 512, 4 prompts of 40 tokens x 4 completions of 8 tokens, micro-batch 8, 3 steps): the
harness's own test, and a smoke run on a GPU.

Reported per precision, each framework and the ratio rlite / TRL (medians of steps 2..N, step 1 being
the warm-up): s/step; generation tokens/s (sampled tokens / the generation phase); trainer
forward + backward tokens/s (prompt + completion tokens / the policy update's forward and backward, the
optimizer step left out); MFU of that forward + backward (:mod:`rlite.perf`'s count on each step's real
sequences, against the device's dense bf16 peak, or ``--peak-tflops``); rlite's own ``perf/mfu`` (all its
trainer passes, optimizer included); peak GPU memory (``torch.cuda.max_memory_allocated`` and
``max_memory_reserved`` of the process: an engine in a process of its own, ``process=true``, is not in it) or,
on CPU, peak RSS. On CUDA both frameworks' phases synchronise
the GPU at their start and end, so that each phase holds its own kernels. Each child gets ``--budget-s``
shared among the children still to run (what a child leaves unspent goes to the next ones), counted from
the child's start: when its share is spent the child stops after the step under way; a child still running
at its share + max(share, 60 s), or at ``--budget-s`` + 60 s from the first child's start, is killed,
and the report says so. The report and the results are rewritten after every child.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path

from vs_trl_common import BenchError, rlite_prompt_ids
from vs_trl_report import gpu_report

SHAPES = {
    "gpu": dict(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab_size=151936,
                tie_word_embeddings=True, max_position_embeddings=2048),
    "gpu-tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab_size=512,
                     tie_word_embeddings=True, max_position_embeddings=256),
}  # fmt: skip
JOBS = {
    "gpu": dict(prompts=16, samples=8, prompt_tokens=205, max_new_tokens=256, micro_batch=32, lr=1e-6, steps=5,
                budget_s=240.0),
    "gpu-tiny": dict(prompts=4, samples=4, prompt_tokens=40, max_new_tokens=8, micro_batch=8, lr=1e-6, steps=3,
                     budget_s=600.0),
}  # fmt: skip
PRECISIONS = ("bf16", "fp32-master")
WORDS = ("seven", "apple", "river", "stone", "cloud", "paper", "green", "light", "table", "music", "north", "glass")


def make_prompts(count: int, tokens: int, tokenizer, seed: int) -> list[str]:
    """``count`` different prompts of exactly ``tokens`` tokens once wrapped in the chat template."""
    overhead = len(rlite_prompt_ids([{"prompt": "x", "answer": "0"}], tokenizer, None)[0]) - 1
    prompts = []
    for index in range(count):
        rng = random.Random(seed * 1000 + index)
        text = f"Prompt {index}: write as many digits as you can after reading these words:"
        while len(text) < tokens:
            text += " " + rng.choice(WORDS)
        text = text[: tokens - overhead]  # the byte tokenizer: one token per ASCII character
        prompts.append(text)
    lengths = [len(ids) for ids in rlite_prompt_ids([{"prompt": p, "answer": "0"} for p in prompts], tokenizer, None)]
    if set(lengths) != {tokens}:
        raise BenchError(f"the prompts came out at {sorted(set(lengths))} tokens, not {tokens}")
    return prompts


def resolve_device(requested: str, job: str) -> str:
    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if requested == "auto" else requested
    if device == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda: no CUDA GPU is visible")
    if device == "cpu" and job == "gpu":
        raise BenchError("the gpu job needs a CUDA GPU (hours on a CPU); its tiny form runs anywhere: vs_trl.py gpu-tiny")
    return device


def peak_tflops(override: float | None, device: str) -> tuple[float | None, str]:
    """The peak MFU is measured against: both precisions compute in bf16."""
    import torch

    from rlite.perf import resolve_peak

    found = resolve_peak(override, torch.device(device), "bf16")
    return (None, "no peak known (CPU, or a GPU not in rlite.perf.PEAK_TFLOPS): MFU not reported") if found is None else found


def run_gpu_job(name: str, args, work_root: Path, run_child) -> str:
    """Build the model and prompts, run every (precision, framework) child, write ``results_<name>.json``
    and ``report_<name>.md`` into the job's folder and return the report."""
    from transformers import AutoConfig

    from rlite.perf import model_shape
    from rlite.tokenizer import build_byte_tokenizer, build_tiny_model_dir

    job = dict(JOBS[name])
    if args.steps is not None:
        job["steps"] = args.steps
    budget = args.budget_s if args.budget_s is not None else job["budget_s"]
    device = resolve_device(args.device, name)
    precisions = args.precisions or list(PRECISIONS)
    work = work_root / name
    work.mkdir(parents=True, exist_ok=True)
    model_dir = build_tiny_model_dir(work / "model", seed=args.seed, **SHAPES[name])
    prompts = make_prompts(job["prompts"], job["prompt_tokens"], build_byte_tokenizer(), args.seed)
    train_file = work / "train.jsonl"
    train_file.write_text("".join(json.dumps({"prompt": p, "answer": "0"}) + "\n" for p in prompts))
    peak, peak_source = peak_tflops(args.peak_tflops, device)
    shape = model_shape(AutoConfig.from_pretrained(model_dir))
    settings = dict(job, device=device, precisions=precisions, budget_s=budget, peak_tflops=peak,
                    peak_source=peak_source, parameters=sum_parameters(model_dir))  # fmt: skip
    children = [(p, f) for p in precisions for f in args.frameworks]
    results: dict[str, dict[str, dict]] = {p: {} for p in precisions}
    failures: dict[str, str] = {}
    started = time.perf_counter()
    hard_end = started + budget + 60.0  # no child runs past this, whatever the shares
    text = ""
    for index, (precision, framework) in enumerate(children):
        tag = f"{name}-{precision}-{framework}"
        now = time.perf_counter()
        share = max(budget - (now - started), 0.0) / (len(children) - index)  # what earlier children left, shared
        timeout = min(share + max(share, 60.0), hard_end - now)
        if share <= 0 or timeout < 10.0:
            failures[tag] = f"not run: the budget of {budget:.0f} s was spent by the processes before it"
        else:
            shutil.rmtree(work / f"{framework}-{precision}", ignore_errors=True)  # rlite's jsonl logger appends
            spec = dict(
                job, model_dir=str(model_dir), train_file=str(train_file), run_dir=str(work), seed=args.seed,
                precision=precision, device=device, reward="digit_fraction", system_prompt=None, ignore_eos=True,
                budget_s=share, threads=None if device == "cuda" else 1, save_model=False,
                peak_tflops=args.peak_tflops, rlite_set=args.rlite_set,
            )  # fmt: skip
            kind = "rlite-gpu" if framework == "rlite" else framework
            try:
                results[precision][framework] = run_child(kind, spec, work, tag, timeout)
            except BenchError as exc:  # the other children still run: a report with a hole beats none
                failures[tag] = str(exc)
                print(f"[vs_trl] {exc}", flush=True)
        # written after every child: a run cut short by an outer timeout keeps what was measured
        text = gpu_report(name, settings, results, shape, failures)
        (work / f"results_{name}.json").write_text(json.dumps(
            {"settings": settings, "results": results, "failures": failures}, indent=1))
        (work / f"report_{name}.md").write_text(text + "\n")
    return text


def sum_parameters(model_dir: Path) -> int:
    """The model's parameters (tied weights once), read from its safetensors headers."""
    from safetensors import safe_open

    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                count = 1
                for size in f.get_slice(key).get_shape():
                    count *= int(size)
                total += count
    return total
