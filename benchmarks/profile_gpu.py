"""Where one rlite GRPO step of the GPU job goes, under ``torch.profiler`` (issue 41's "profile first").

Each run trains the job of ``vs_trl.py gpu`` (``vs_trl_gpu.py``: 16 prompts of 205 tokens x 8 completions of
256 new tokens, micro-batch 32, rlite's defaults) for ``--steps`` steps in a process of its own and profiles
the last one, with CPU and CUDA activities (CPU only without a GPU). Runs (``--runs``, comma list):

* ``fsdp2:dense``: the FSDP2 backend on a random Qwen2 of Qwen2.5-0.5B's shape (494M parameters);
* ``megatron:dense``: the megatron-core backend on the same model, one GPU;
* ``megatron:moe``: the megatron-core backend on a random Qwen3-MoE (hidden 1024, 8 layers, 16 heads, 4 KV
  heads, 16 experts of 704, top-4, vocabulary 151,936: ~0.45B parameters): ``configs/moe_megatron_gpu.yaml``'s
  routed-expert layout, small enough to build and train in a minute (that recipe's Qwen1.5-MoE-A2.7B has
  14B parameters).

``--shape tiny`` (the default without a GPU) shrinks the models and the job to ``vs_trl.py gpu-tiny``'s, so
the script runs on a CPU in seconds. For each run it reports:

* **time per phase** of the profiled step: wall seconds from rlite's own ``time/*`` metrics (generation,
  reward, scoring = ``logprobs``: pi_old/pi_ref and advantages, ``train/forward``, ``train/backward``,
  ``train/optimizer``, ``weight_sync``), and from the trace the GPU's busy time inside each phase (the union
  of its kernels, memory copies and sets), its idle share and its kernel count. Every phase is annotated
  (``record_function("rlite/<phase>")``) and, on CUDA, synchronises the GPU at its start and end, so the
  kernels a phase launches run inside it;
* **host gaps**: the GPU's idle time between kernels over the step (the host is then the bottleneck: Python,
  launches, synchronisations), by gap length, and the longest gaps with the kernels on either side;
* **top kernels** by GPU time (name, calls, total, mean, share), and the top operators by self CPU time.

Written to ``--out``: ``profile_gpu.md`` (the tables) and ``profile_gpu.json`` (the same numbers), two small
files whatever the runs; a run that fails or outlives its share of ``--budget-s`` is reported as such.

    python benchmarks/profile_gpu.py --out /tmp/profile                      # on a GPU: fsdp2, dense
    python benchmarks/profile_gpu.py --runs fsdp2:dense,megatron:dense,megatron:moe --out /tmp/profile
    python benchmarks/profile_gpu.py --device cpu --runs fsdp2:dense,megatron:moe --out /tmp/profile   # tiny, CPU
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

RUNS = {"fsdp2:dense": ("fsdp2", "dense"), "megatron:dense": ("megatron", "dense"), "megatron:moe": ("megatron", "moe")}
MOE_MODELS = {
    "gpu": dict(hidden=1024, layers=8, heads=16, kv_heads=4, intermediate=2816, vocab_size=151936,
                tie_word_embeddings=True, max_position_embeddings=2048, num_experts=16, experts_per_token=4,
                expert_intermediate=704),
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab_size=512, tie_word_embeddings=True,
                 max_position_embeddings=256, num_experts=4, experts_per_token=2),
}  # fmt: skip
PHASES = ("generation", "reward", "logprobs", "train/forward", "train/backward", "train/optimizer", "weight_sync")
"""The rlite phases reported, in step order (``logprobs`` is the scoring: pi_old, pi_ref, advantages)."""
GAP_BUCKETS_US = (10.0, 100.0, 1000.0, 10000.0)
"""Upper bounds of the host-gap lengths tallied apart (the last bucket is everything longer)."""


# --------------------------------------------------------------------------------------------------
# the analysis (pure functions of intervals in microseconds)
# --------------------------------------------------------------------------------------------------


def merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``(start, end)`` intervals as disjoint sorted intervals (kernels of several streams overlap)."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out]


def busy_within(merged: list[tuple[float, float]], start: float, end: float) -> float:
    """How long the merged intervals cover inside ``[start, end]``."""
    return sum(max(0.0, min(e, end) - max(s, start)) for s, e in merged)


def gap_summary(kernels: list[tuple[str, float, float]], window: tuple[float, float], longest: int = 10) -> dict:
    """The GPU's idle time inside ``window`` between the ``(name, start, end)`` device activities: total, by gap
    length (:data:`GAP_BUCKETS_US`), and the ``longest`` gaps with the activities before and after them."""
    start, end = window
    inside = sorted((k for k in kernels if k[2] > start and k[1] < end), key=lambda k: k[1])
    merged = merge([(max(s, start), min(e, end)) for _, s, e in inside])
    busy = sum(e - s for s, e in merged)
    edges = [start] + [t for interval in merged for t in interval] + [end]
    gaps = [(edges[i], edges[i + 1]) for i in range(0, len(edges), 2) if edges[i + 1] > edges[i]]
    bounds = (*GAP_BUCKETS_US, float("inf"))
    buckets = []
    for low, high in zip((0.0, *GAP_BUCKETS_US), bounds):
        lengths = [e - s for s, e in gaps if low < e - s <= high]
        buckets.append({"from_us": low, "to_us": high, "gaps": len(lengths), "idle_us": sum(lengths)})

    def neighbour(time_us: float, before: bool) -> str:
        names = [k[0] for k in inside if (k[2] <= time_us if before else k[1] >= time_us)]
        return (names[-1] if before else names[0]) if names else "(step edge)"

    top = sorted(gaps, key=lambda g: g[0] - g[1])[:longest]
    return {
        "window_us": end - start,
        "busy_us": busy,
        "idle_us": (end - start) - busy,
        "idle_fraction": 1.0 - busy / (end - start) if end > start else 0.0,
        "buckets": buckets,
        "longest": [{"start_us": s - start, "length_us": e - s, "after": neighbour(s, True), "before": neighbour(e, False)}
                    for s, e in top],
    }  # fmt: skip


def top_kernels(kernels: list[tuple[str, float, float]], count: int) -> list[dict]:
    """The ``count`` device activities with the most total time: name, calls, total ms, mean us, share."""
    totals: dict[str, list[float]] = {}
    for name, start, end in kernels:
        entry = totals.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += end - start
    everything = sum(t for _, t in totals.values()) or 1.0
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][1])[:count]
    return [{"name": name, "calls": int(calls), "total_ms": total / 1e3, "mean_us": total / calls, "share": total / everything}
            for name, (calls, total) in ranked]  # fmt: skip


def phase_table(annotations: list[tuple[str, float, float]], kernels: list[tuple[str, float, float]],
                metrics: dict[str, float]) -> list[dict]:
    """Per rlite phase: wall seconds (``time/<phase>``), the annotated seconds in the trace, the GPU's busy
    seconds inside them, the idle share and the number of device activities that started inside (the GPU
    columns None when the trace has no device activity: a CPU run)."""
    merged = merge([(s, e) for _, s, e in kernels])
    rows = []
    for phase in PHASES:
        spans = [(s, e) for name, s, e in annotations if name == f"rlite/{phase}"]
        traced = sum(e - s for s, e in spans)
        busy = sum(busy_within(merged, s, e) for s, e in spans)
        launched = sum(1 for _, ks, _ in kernels for s, e in spans if s <= ks < e)
        rows.append({"phase": phase, "wall_s": float(metrics.get(f"time/{phase}", 0.0)), "traced_s": traced / 1e6,
                     "gpu_busy_s": busy / 1e6 if kernels else None,
                     "gpu_idle_fraction": 1.0 - busy / traced if traced and kernels else None,
                     "kernels": launched if kernels else None})  # fmt: skip
    return rows


# --------------------------------------------------------------------------------------------------
# the child: one profiled run
# --------------------------------------------------------------------------------------------------


def annotate_phases() -> None:
    """Every ``rlite.metrics.StepTimer`` phase also runs under ``record_function("rlite/<phase>")``, and on
    CUDA synchronises the GPU at its start and end (``vs_trl_child_rlite.synchronized_phases``)."""
    from contextlib import contextmanager

    from torch.profiler import record_function
    from vs_trl_child_rlite import synchronized_phases

    from rlite.metrics import StepTimer

    synchronized_phases()
    timed = StepTimer.phase

    @contextmanager
    def phase(self, name: str):
        with record_function(f"rlite/{name}"), timed(self, name):
            yield

    StepTimer.phase = phase


def trace_intervals(prof) -> tuple[list[tuple[str, float, float]], list[tuple[str, float, float]]]:
    """``(device activities, rlite phase annotations)`` of a finished profile, as ``(name, start_us, end_us)``."""
    from torch.autograd import DeviceType

    events = list(prof.events())
    # a record_function range (rlite's phases, torch's own "Optimizer.step#...") is also projected onto the GPU
    # timeline as an annotation: not a kernel, whether or not this torch flags it as one
    annotations = {e.name for e in events if e.device_type == DeviceType.CPU and getattr(e, "is_user_annotation", False)}
    annotations |= {e.name for e in events if e.name.startswith("rlite/")}
    device, phases = [], []
    for event in events:
        start, end = event.time_range.start, event.time_range.end
        if event.device_type == DeviceType.CPU:
            if event.name.startswith("rlite/"):
                phases.append((event.name, start, end))
        elif event.device_type == DeviceType.CUDA and event.name not in annotations \
                and not getattr(event, "is_user_annotation", False):
            device.append((event.name, start, end))
    return device, phases


def top_cpu_ops(prof, count: int) -> list[dict]:
    ops = [e for e in prof.key_averages() if not e.key.startswith("rlite/")]  # the phases are not operators
    rows = sorted(ops, key=lambda e: -e.self_cpu_time_total)[:count]
    return [{"name": e.key, "calls": int(e.count), "self_cpu_ms": e.self_cpu_time_total / 1e3,
             "cpu_total_ms": e.cpu_time_total / 1e3} for e in rows]  # fmt: skip


def profile_run(spec: dict) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile
    from vs_trl_child_rlite import gpu_overrides
    from vs_trl_common import device_memory_gib, digit_fraction, read_jsonl

    import rlite
    from rlite.config import load_config
    from rlite.plugin_manager import build_plugin_manager
    from rlite.run.loop import run_training

    annotate_phases()
    on_cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    target = spec["steps"]

    class ProfileWindow:
        """Profiles step ``target``: from the previous step's ``on_metrics`` (or the run's start) to its own."""

        def __init__(self) -> None:
            self.prof = None
            self.done = None

        def start(self) -> None:
            self.prof = profile(activities=activities)
            self.prof.__enter__()

        @rlite.hookimpl
        def register_reward_functions(self, register):
            register("digit_fraction", lambda completion, sample, cfg: digit_fraction(completion))

        @rlite.hookimpl
        def on_run_start(self, config, run_dir):
            if target == 1:
                self.start()

        @rlite.hookimpl
        def on_metrics(self, step, metrics):
            if step == target - 1 and step >= 1:
                self.start()
            elif step == target and self.prof is not None:
                self.prof.__exit__(None, None, None)
                self.done = self.prof

    window = ProfileWindow()
    pm = build_plugin_manager(autoload=False)
    pm.register(window, name="bench-profile-window")
    overrides = gpu_overrides(spec, Path(spec["run_dir"]))
    if spec["backend"] == "megatron":
        import rlite.plugins.megatron as megatron_plugin

        pm.register(megatron_plugin, name="rlite.plugins.megatron")
        overrides.append("parallelism.backend=megatron")
    cfg = load_config(None, overrides, pm=pm)
    run_training(cfg, pm)
    if window.done is None:
        raise RuntimeError(f"step {target} was not profiled")
    rows = {r["step"]: r for r in read_jsonl(Path(spec["run_dir"]) / "metrics.jsonl")}
    metrics = rows[target]
    kernels, annotations = trace_intervals(window.done)
    spans = [(s, e) for _, s, e in annotations]
    step_window = (min(s for s, _ in spans), max(e for _, e in spans)) if spans else (0.0, 0.0)
    return {
        "backend": spec["backend"], "model": spec["model"], "device": torch.cuda.get_device_name() if on_cuda else "cpu",
        "torch": torch.__version__, "parameters": spec["parameters"], "precision": spec["precision"], "step": target,
        "job": {k: spec[k] for k in ("prompts", "samples", "prompt_tokens", "max_new_tokens", "micro_batch")},
        "metrics": {k: v for k, v in metrics.items() if k.startswith(("time/", "perf/", "response/"))},
        "phases": phase_table(annotations, kernels, metrics),
        "gaps": gap_summary(kernels, step_window) if kernels else None,
        "top_kernels": top_kernels(kernels, spec["top"]),
        "top_cpu_ops": top_cpu_ops(window.done, spec["top"]),
        "device_memory": device_memory_gib(),
    }  # fmt: skip


# --------------------------------------------------------------------------------------------------
# the report
# --------------------------------------------------------------------------------------------------


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def run_markdown(tag: str, run: dict) -> str:
    if "error" in run:
        return f"## {tag}\n\n{run['error']}\n"
    job = run["job"]
    perf = run["metrics"]
    lines = [
        f"## {tag}: {run['parameters']:,} parameters, {run['precision']}, {run['device']}, step {run['step']} profiled",
        "",
        f"{job['prompts']} prompts of {job['prompt_tokens']} tokens x {job['samples']} completions of up to "
        f"{job['max_new_tokens']} new tokens, micro-batch {job['micro_batch']}; torch {run['torch']}; step "
        f"{perf.get('time/step', 0):.3f} s, trainer {_fmt(perf.get('perf/model_tflops'), '.3g')} model TFLOP/s per device"
        + (f", MFU {perf['perf/mfu']:.1%}" if "perf/mfu" in perf else "")
        + (f"; peak GPU memory {run['device_memory']['peak_allocated_gib']:.2f} GiB allocated, "
           f"{run['device_memory']['peak_reserved_gib']:.2f} GiB reserved" if run["device_memory"] else "") + ".",
        "",
        "| phase | wall s (time/*) | traced s | GPU busy s | GPU idle | kernels |",
        "|---|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    for row in run["phases"]:
        lines.append(f"| {row['phase']} | {row['wall_s']:.4f} | {row['traced_s']:.4f} | {_fmt(row['gpu_busy_s'], '.4f')} | "
                     f"{_fmt(row['gpu_idle_fraction'], '.1%')} | {_fmt(row['kernels'], 'd')} |")  # fmt: skip
    gaps = run["gaps"]
    if gaps is None:
        lines += ["", "Host gaps: no CUDA activity (a CPU run): see the operators below."]
    else:
        lines += ["", f"Host gaps: the GPU idled {gaps['idle_us'] / 1e6:.3f} s of the step's {gaps['window_us'] / 1e6:.3f} s "
                      f"({gaps['idle_fraction']:.1%}).", "", "| gap length | gaps | idle s |", "|---|---:|---:|"]  # fmt: skip
        for b in gaps["buckets"]:
            high = "longer" if b["to_us"] == float("inf") else f"<= {b['to_us']:g} us"
            lines.append(f"| > {b['from_us']:g} us, {high} | {b['gaps']} | {b['idle_us'] / 1e6:.4f} |")
        lines += ["", "| longest gaps, us | at, s into the step | after | before |", "|---:|---:|---|---|"]
        for g in gaps["longest"]:
            lines.append(f"| {g['length_us']:.0f} | {g['start_us'] / 1e6:.4f} | {g['after'][:70]} | {g['before'][:70]} |")
        lines += ["", "| top kernels by GPU time | calls | total ms | mean us | share |", "|---|---:|---:|---:|---:|"]
        for k in run["top_kernels"]:
            lines.append(f"| {k['name'][:90]} | {k['calls']} | {k['total_ms']:.2f} | {k['mean_us']:.1f} | {k['share']:.1%} |")
    lines += ["", "| top operators by self CPU time | calls | self CPU ms | CPU total ms |", "|---|---:|---:|---:|"]
    for op in run["top_cpu_ops"]:
        lines.append(f"| {op['name'][:90]} | {op['calls']} | {op['self_cpu_ms']:.2f} | {op['cpu_total_ms']:.2f} |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------
# the command
# --------------------------------------------------------------------------------------------------


def build_models(shape: str, models: set[str], work: Path, seed: int) -> dict[str, tuple[Path, int]]:
    from vs_trl_gpu import SHAPES, sum_parameters

    from rlite.tokenizer import build_tiny_model_dir

    out = {}
    for model in sorted(models):
        dims = SHAPES["gpu" if shape == "gpu" else "gpu-tiny"] if model == "dense" else MOE_MODELS[shape]
        path = build_tiny_model_dir(work / f"model-{model}", seed=seed, **dims)
        out[model] = (path, sum_parameters(path))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default="fsdp2:dense", help=f"comma list of {', '.join(RUNS)}")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--shape", choices=["auto", "gpu", "tiny"], default="auto",
                        help="the models and job: gpu (vs_trl.py gpu's) or tiny (gpu-tiny's); auto: gpu on CUDA")
    parser.add_argument("--steps", type=int, default=2, help="steps per run; the last is profiled (default 2)")
    parser.add_argument("--new-tokens", type=int, default=None, help="max_new_tokens (default: the job's, 256 / 8)")
    parser.add_argument("--precision", choices=["bf16", "fp32-master"], default="bf16")
    parser.add_argument("--top", type=int, default=25, help="rows of the kernel and operator tables")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds for all runs together, shared among the runs left (a run past its share is killed)")
    parser.add_argument("--out", required=True, help="folder for profile_gpu.md and profile_gpu.json")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child", nargs=2, metavar=("SPEC_JSON", "RESULT_JSON"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        spec = json.loads(Path(args.child[0]).read_text())
        Path(args.child[1]).write_text(json.dumps(profile_run(spec), indent=1))
        return 0
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    unknown = [r for r in runs if r not in RUNS]
    if unknown or not runs:
        parser.error(f"--runs: unknown {unknown}; choose from {', '.join(RUNS)}")
    import torch
    from vs_trl_gpu import JOBS, make_prompts

    from rlite.tokenizer import build_byte_tokenizer

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU is visible")
    shape = ("gpu" if device == "cuda" else "tiny") if args.shape == "auto" else args.shape
    job = dict(JOBS["gpu" if shape == "gpu" else "gpu-tiny"], steps=args.steps)
    if args.new_tokens:
        job["max_new_tokens"] = args.new_tokens
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1", RLITE_DISABLE_PLUGIN_AUTOLOAD="1", WANDB_DISABLED="true",
               **({} if device == "cuda" else {"CUDA_VISIBLE_DEVICES": ""}))  # fmt: skip
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="rlite-profile-") as tmp:
        work = Path(tmp)
        models = build_models(shape, {RUNS[r][1] for r in runs}, work, args.seed)
        train_file = work / "train.jsonl"
        prompts = make_prompts(job["prompts"], job["prompt_tokens"], build_byte_tokenizer(), args.seed)
        train_file.write_text("".join(json.dumps({"prompt": p, "answer": "0"}) + "\n" for p in prompts))
        for index, tag in enumerate(runs):
            backend, model = RUNS[tag]
            spec = dict(job, backend=backend, model=model, model_dir=str(models[model][0]), parameters=models[model][1],
                        train_file=str(train_file), run_dir=str(work / tag.replace(":", "-")), seed=args.seed,
                        precision=args.precision, ignore_eos=True, top=args.top)  # fmt: skip
            spec_path, result_path, log_path = (work / f"{tag.replace(':', '-')}.{x}" for x in ("spec.json", "json", "log"))
            spec_path.write_text(json.dumps(spec))
            timeout = None
            if args.budget_s is not None:
                timeout = max((args.budget_s - (time.perf_counter() - started)) / (len(runs) - index), 1.0)
            print(f"[profile_gpu] {tag} on {device} ({models[model][1]:,} parameters) ...", flush=True)
            try:
                with open(log_path, "w") as log:
                    done = subprocess.run([sys.executable, __file__, "--out", str(out), "--child", str(spec_path),
                                           str(result_path)], stdout=log, stderr=subprocess.STDOUT, env=env,
                                          cwd=str(HERE.parent), timeout=timeout)  # fmt: skip
                if done.returncode != 0 or not result_path.is_file():
                    tail = "".join(log_path.read_text().splitlines(keepends=True)[-15:])
                    results[tag] = {"error": f"failed (exit {done.returncode}); last lines of its log:\n\n```\n{tail}```"}
                else:
                    results[tag] = json.loads(result_path.read_text())
            except subprocess.TimeoutExpired:
                results[tag] = {"error": f"killed after {timeout:.0f} s, its share of --budget-s {args.budget_s:.0f}"}
            (out / "profile_gpu.json").write_text(json.dumps(results, indent=1))  # after every run: a kill keeps the rest
            report = "\n".join(run_markdown(t, r) for t, r in results.items())
            (out / "profile_gpu.md").write_text(f"# rlite GPU profile ({device})\n\n{report}")
    print((out / "profile_gpu.md").read_text(), flush=True)
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
