"""The tables ``vs_trl.py`` prints from the children's results: the side-by-side summary with ratios,
the time per phase of each framework, and (``--memory-phases``) the peak memory inside each phase.

A result is the dict a training child returns: ``step_times`` and ``step_cpu`` (s per step),
``tokens`` and ``rewards`` per step, ``phases`` (per step ``{phase: [wall s, CPU s]}``, exclusive
phases that add up to at most the step), ``peak_rss_mib``, ``setup_s``, ``version``.
"""

from __future__ import annotations

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
