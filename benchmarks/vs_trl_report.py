"""The tables ``vs_trl.py`` prints from the children's results: the side-by-side summary with ratios,
the time per phase of each framework, and (``--memory-phases``) the peak memory inside each phase.

A result is the dict a training child returns: ``step_times`` and ``step_cpu`` (s per step),
``tokens`` and ``rewards`` per step, ``phases`` (per step ``{phase: [wall s, CPU s]}``, exclusive
phases that add up to at most the step), ``peak_rss_mib``, ``setup_s``, ``version``.
"""

from __future__ import annotations

import math
import statistics


def _steady(values: list[float]) -> list[float]:
    """Steps 2..N (step 1 is the warm-up), or all of them when there is only one."""
    return values[1:] or values


def stats(result: dict, last: int = 5) -> dict:
    wall, cpu, tokens = result["step_times"], result["step_cpu"], result["tokens"]
    gen_keys = [k for k in result["phases"][0] if k.startswith("generation")]
    gen_wall = sum(sum(p[k][0] for k in gen_keys) for p in _steady(result["phases"]))
    gen_cpu = sum(sum(p[k][1] for k in gen_keys) for p in _steady(result["phases"]))
    steady_tokens = sum(_steady(tokens))
    return {
        "first_step_s": wall[0],
        "median_step_s": statistics.median(_steady(wall)),
        "mean_step_s": statistics.fmean(_steady(wall)),
        "median_step_cpu_s": statistics.median(_steady(cpu)),
        "mean_step_cpu_s": statistics.fmean(_steady(cpu)),
        "tok_per_s": steady_tokens / sum(_steady(wall)),
        "tok_per_cpu_s": steady_tokens / sum(_steady(cpu)),
        "gen_tok_per_s": steady_tokens / gen_wall if gen_wall else float("nan"),
        "gen_tok_per_cpu_s": steady_tokens / gen_cpu if gen_cpu else float("nan"),
        "tokens_per_step": statistics.fmean(tokens),
        "peak_rss_gib": result["peak_rss_mib"] / 1024,
        "final_reward": statistics.fmean(result["rewards"][-last:]),
        "setup_s": result["setup_s"],
    }


ROWS = [
    ("first step (warm-up), wall s", "first_step_s", "{:.2f}"),
    ("step time, median of steps 2..N, wall s", "median_step_s", "{:.3f}"),
    ("step time, mean of steps 2..N, wall s", "mean_step_s", "{:.3f}"),
    ("step time, median of steps 2..N, CPU s", "median_step_cpu_s", "{:.3f}"),
    ("step time, mean of steps 2..N, CPU s", "mean_step_cpu_s", "{:.3f}"),
    ("generated tokens / wall s (whole step)", "tok_per_s", "{:.0f}"),
    ("generated tokens / CPU s (whole step)", "tok_per_cpu_s", "{:.0f}"),
    ("generated tokens / wall s (generation phase only)", "gen_tok_per_s", "{:.0f}"),
    ("generated tokens / CPU s (generation phase only)", "gen_tok_per_cpu_s", "{:.0f}"),
    ("generated tokens per step (mean)", "tokens_per_step", "{:.0f}"),
    ("peak RSS, GiB", "peak_rss_gib", "{:.2f}"),
    ("final reward (mean of last 5 steps)", "final_reward", "{:.3f}"),
    ("setup before step 1 (imports, model, data), wall s", "setup_s", "{:.1f}"),
]


def table(job_name: str, ours: dict, theirs: dict, acc: dict | None, steps: int) -> str:
    a, b = stats(ours), stats(theirs)
    lines = [
        f"| {job_name}, {steps} steps | rlite {ours['version']} | TRL {theirs['version']} | rlite / TRL |",
        "|---|---:|---:|---:|",
    ]
    for label, key, fmt in ROWS:
        ratio = a[key] / b[key] if b[key] else float("nan")
        lines.append(f"| {label} | {fmt.format(a[key])} | {fmt.format(b[key])} | {ratio:.2f} |")
    if acc:
        base = acc.get("initial", {}).get("accuracy")
        ra, ta = acc["rlite"]["accuracy"], acc["trl"]["accuracy"]
        ratio = f"{ra / ta:.2f}" if ta else "-"
        note = f" (initial model: {base:.3f})" if base is not None else ""
        lines.append(f"| held-out greedy accuracy, 64 prompts{note} | {ra:.3f} | {ta:.3f} | {ratio} |")
    return "\n".join(lines)


def breakdown(ours: dict, theirs: dict) -> str:
    lines = [
        "| framework | phase | wall s / step | CPU s / step | share of wall step |",
        "|---|---|---:|---:|---:|",
    ]
    for name, result in (("rlite", ours), ("TRL", theirs)):
        steps = _steady(result["phases"])
        wall = statistics.fmean(_steady(result["step_times"]))
        cpu = statistics.fmean(_steady(result["step_cpu"]))
        phases = {k: [statistics.fmean(p[k][i] for p in steps) for i in (0, 1)] for k in steps[0]}
        for key, (w, c) in phases.items():
            lines.append(f"| {name} | {key} | {w:.3f} | {c:.3f} | {100 * w / wall:.0f}% |")
        ow, oc = wall - sum(v[0] for v in phases.values()), cpu - sum(v[1] for v in phases.values())
        lines.append(
            f"| {name} | rest of the loop (logging, callbacks, ...) | {ow:.3f} | {oc:.3f} | {100 * ow / wall:.0f}% |"
        )
        lines.append(f"| {name} | **whole step** | **{wall:.3f}** | **{cpu:.3f}** | 100% |")
    return "\n".join(lines)


def memory_table(results: dict) -> str:
    """The peak resident memory sampled inside each phase (``--memory-phases``), highest first."""
    lines = []
    for framework, result in results.items():
        live = result.get("peak_live_by_phase", {})
        for phase, mib in sorted(result.get("peak_rss_by_phase", {}).items(), key=lambda kv: -kv[1]):
            live_gib = f"{live[phase] / 1024:.2f}" if phase in live else "-"
            lines.append(f"| {framework} | {phase} | {mib / 1024:.2f} | {live_gib} |")
    if not lines:
        return ""
    head = (
        "\n\nPeak resident memory inside each phase (sampled every 2 ms), and the peak of the bytes malloc had"
        " handed out (live, sampled every 20 ms; RSS above it is kept by the allocator or is not malloc's)."
        " The sampling slows the run: take timings from a run without --memory-phases.\n\n"
        "| framework | phase | RSS, GiB | live malloc, GiB |\n|---|---|---:|---:|\n"
    )
    return head + "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# the GPU job (vs_trl_gpu.py)
# --------------------------------------------------------------------------------------------------

TARGETS = (
    # (row key, comparison, bound, where the bound comes from)
    ("gen_tok_per_s", ">=", 4.0, "issue 40: generation tokens/s at least 4x TRL's"),
    ("median_step_s", "<=", 0.5, "issue 40: s/step at most 0.5x TRL's"),
    ("peak_memory_gib", "<=", 0.6, "issues 40 and 41: peak GPU memory (allocated) at most 0.6x TRL's"),
    ("trainer_tok_per_s", ">=", 1.0, "issue 41: trainer forward + backward tokens/s at least TRL's"),
)


def _phase_sum(phases: dict[str, list[float]], *prefixes: str) -> float:
    return sum(wall for key, (wall, _cpu) in phases.items() if key.startswith(prefixes))


def gpu_stats(result: dict, shape, peak_tflops: float | None) -> dict:
    """One framework's numbers on the GPU job: medians and throughputs over steps 2..N (step 1 is the warm-up;
    all steps when there is only one)."""
    from rlite.perf import SequenceSums, forward_backward_flops

    steps = len(result["step_times"])
    keep = list(range(1, steps)) or list(range(steps))
    phases = [result["phases"][i] for i in keep]
    generation = sum(_phase_sum(p, "generation") for p in phases)
    update = sum(_phase_sum(p, "train: forward", "train: backward") for p in phases)
    sums = [SequenceSums(*result["sequence_sums"][i]) for i in keep]
    flops = sum(forward_backward_flops(shape, s) for s in sums)
    memory = result.get("device_memory") or {}
    out = {
        "steps": float(steps),
        "median_step_s": statistics.median(result["step_times"][i] for i in keep),
        "gen_tok_per_s": sum(result["tokens"][i] for i in keep) / generation if generation else math.nan,
        "trainer_tok_per_s": sum(s.tokens for s in sums) / update if update else math.nan,
        "update_tflops": flops / update / 1e12 if update else math.nan,
        "mfu": flops / update / (peak_tflops * 1e12) if update and peak_tflops else math.nan,
        "generated_tokens_per_step": statistics.fmean(result["tokens"][i] for i in keep),
        "trained_tokens_per_step": statistics.fmean(s.tokens for s in sums),
        "peak_memory_gib": memory.get("peak_allocated_gib", result["peak_rss_mib"] / 1024),
        "peak_reserved_gib": memory.get("peak_reserved_gib", math.nan),
    }
    own = [result["own_perf"][i].get("perf/mfu") for i in keep] if "own_perf" in result else []
    out["own_mfu"] = statistics.fmean(own) if own and None not in own else math.nan
    return out


def gpu_rows(on_gpu: bool) -> list[tuple[str, str, str]]:
    """``(label, stats key, format)`` of the GPU job's table (a ratio for each but :data:`NO_RATIO`)."""
    memory = "peak GPU memory allocated (torch.cuda.max_memory_allocated), GiB" if on_gpu else "peak RSS, GiB"
    rows = [
        ("steps run (medians over steps 2..N)", "steps", "{:.0f}"),
        ("s/step, median", "median_step_s", "{:.3f}"),
        ("generation tokens/s (sampled tokens / generation phase)", "gen_tok_per_s", "{:,.0f}"),
        ("trainer forward+backward tokens/s (prompt + completion tokens / update forward + backward)",
         "trainer_tok_per_s", "{:,.0f}"),
        ("update forward+backward model TFLOP/s", "update_tflops", "{:.3g}"),
        ("MFU of the update's forward+backward", "mfu", "{:.1%}"),
        ("rlite's own perf/mfu (all trainer passes, optimizer included)", "own_mfu", "{:.1%}"),
        ("generated tokens per step", "generated_tokens_per_step", "{:,.0f}"),
        ("trained tokens per step (prompt + completion)", "trained_tokens_per_step", "{:,.0f}"),
        (memory, "peak_memory_gib", "{:.2f}"),
    ]
    if on_gpu:
        rows.append(("peak GPU memory reserved (torch.cuda.max_memory_reserved), GiB", "peak_reserved_gib", "{:.2f}"))
    return rows


NO_RATIO = ("steps", "own_mfu")
"""Rows whose ratio means nothing: the steps each ran (set by the budget), a number only rlite reports."""


def _cell(fmt: str, value: float) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else fmt.format(value)


def gpu_table(precision: str, ours: dict | None, theirs: dict | None, on_gpu: bool, versions: tuple[str, str]) -> str:
    lines = [f"| {precision} | rlite {versions[0]} | TRL {versions[1]} | rlite / TRL |", "|---|---:|---:|---:|"]
    for label, key, fmt in gpu_rows(on_gpu):
        a = ours.get(key, math.nan) if ours else math.nan
        b = theirs.get(key, math.nan) if theirs else math.nan
        ratio = a / b if b and not math.isnan(a) and not math.isnan(b) and key not in NO_RATIO else math.nan
        lines.append(f"| {label} | {_cell(fmt, a)} | {_cell(fmt, b)} | {_cell('{:.2f}x', ratio)} |")
    return "\n".join(lines)


def target_lines(precision: str, ours: dict, theirs: dict) -> list[str]:
    lines = []
    for key, op, bound, what in TARGETS:
        ratio = ours[key] / theirs[key] if theirs.get(key) else math.nan
        met = ratio >= bound if op == ">=" else ratio <= bound
        lines.append(f"- {precision}: {what}: {ratio:.2f}x, {'met' if met else 'NOT met'}")
    return lines


def gpu_report(job: str, settings: dict, results: dict[str, dict[str, dict]], shape, failures: dict[str, str]) -> str:
    """The markdown report of the GPU job: settings, one table per precision, the issues' targets (on a GPU)."""
    on_gpu = settings["device"] == "cuda"
    any_result = next((r for per in results.values() for r in per.values()), {})
    device = any_result.get("device", settings["device"])
    versions = tuple(next((per[f]["version"] for per in results.values() if f in per), "?") for f in ("rlite", "trl"))
    out = [
        f"### {job}: rlite vs TRL on {device}",
        "",
        f"{settings['parameters']:,} parameters; {settings['prompts']} prompts of {settings['prompt_tokens']} tokens x "
        f"{settings['samples']} completions of {settings['max_new_tokens']} new tokens, micro-batch "
        f"{settings['micro_batch']}, lr {settings['lr']}, up to {settings['steps']} steps per process, budget "
        f"{settings['budget_s']:.0f} s; torch {any_result.get('torch', '?')}. MFU against "
        + (f"{settings['peak_tflops']:g} TFLOP/s ({settings['peak_source']})." if settings["peak_tflops"]
           else settings["peak_source"] + "."),
        "",
    ]
    judged = []
    for precision, per in results.items():
        stats_ = {f: gpu_stats(r, shape, settings["peak_tflops"]) for f, r in per.items()}
        out += [gpu_table(precision, stats_.get("rlite"), stats_.get("trl"), on_gpu, versions), ""]
        for framework, r in per.items():
            notes = [f"EOS: {r['ignore_eos']}"] + ([r["stopped"]] if r.get("stopped") else [])
            out.append(f"- {precision}, {framework}: " + "; ".join(notes))
        if on_gpu and len(stats_) == 2:
            judged += target_lines(precision, stats_["rlite"], stats_["trl"])
        out.append("")
    for tag, message in failures.items():
        out.append(f"- {tag}: FAILED: {message.splitlines()[0]}")
    if judged:
        out += ["", "Targets:", *judged]
    elif not on_gpu:
        out.append("The issues' targets (ratios on a GPU) are not judged on a CPU.")
    return "\n".join(out)
