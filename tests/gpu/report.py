"""Write the markdown report of a GPU-check run: the machine, each check's result, the measured numbers.

    python tests/gpu/report.py --junit results.xml --metrics metrics.jsonl [--log pytest.log] [--out report.md]

Reads pytest's JUnit XML (pass / fail / skip of every test) and the numbers the tests recorded with
the ``measure`` fixture (``tests/gpu/conftest.py``). Prints the report; ``--out`` also writes it.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import platform
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

CHECKS = {
    "test_fsdp2_bf16": "1. FSDP2 on CUDA, bf16 mixed precision",
    "test_process_engine_cuda_ipc": "2. Spawned engine fed over CUDA-IPC buckets",
    "test_true_on_policy_cuda": "3. True on-policy mode on CUDA",
    "test_liger_cuda": "4. liger-kernel fused log-probs",
    "test_process_group": "5. Default process group: host tensors over gloo, CUDA tensors over NCCL",
    "test_megatron_cuda": "6. megatron backend on CUDA (no Transformer Engine)",
    "test_sglang_gpu": "SGLang engine (needs sglang installed)",
}


def machine() -> list[str]:
    lines = [f"- date (UTC): {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}",
             f"- python {platform.python_version()} on {platform.machine()}"]
    try:
        import torch

        lines.append(f"- torch {torch.__version__} (CUDA {torch.version.cuda})")
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            lines.append(f"- GPU: {props.name}, {props.total_memory / 2**30:.0f} GiB, "
                         f"compute capability {props.major}.{props.minor}, {torch.cuda.device_count()} visible")
    except ImportError:
        lines.append("- torch: not installed")
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.strip()
        if driver:
            lines.append(f"- NVIDIA driver {driver.splitlines()[0]}")
    except (OSError, subprocess.SubprocessError):
        pass
    versions = []
    for package in ("transformers", "triton", "liger-kernel", "peft", "omegaconf", "sglang"):
        try:
            versions.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{package} (not installed)")
    lines.append("- " + ", ".join(versions))
    return lines


def results(junit: Path) -> list[tuple[str, str, str, str]]:
    """``(check, test, outcome, detail)`` for every test case in the JUnit XML."""
    rows = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")[-1]
        check = next((title for key, title in CHECKS.items() if key in module or key in case.get("file", "")), module)
        outcome, detail = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "FAILED", "error": "ERROR", "skipped": "skipped"}[tag]
                detail = (node.get("message") or node.text or "").strip().splitlines()[0][:300] if (
                    node.get("message") or node.text) else ""
                break
        rows.append((check, case.get("name", ""), outcome, detail))
    return rows


def _cell(text: object) -> str:
    """Text that stays inside one markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def render(junit: Path | None, metrics: Path | None, skipped_reason: str | None = None) -> str:
    out = ["# rlite GPU checks (tests/gpu)", "", *machine(), ""]
    if skipped_reason:
        return "\n".join([*out, f"**Skipped**: {skipped_reason}", ""])
    rows = results(junit) if junit and junit.exists() else []
    if not rows:
        return "\n".join([*out, "**No results**: pytest wrote no JUnit report (see the log).", ""])
    counts = {o: sum(r[2] == o for r in rows) for o in ("passed", "FAILED", "ERROR", "skipped")}
    out += [", ".join(f"{n} {o.lower()}" for o, n in counts.items() if n), "",
            "| check | test | result | detail |", "| --- | --- | --- | --- |"]
    out += [f"| {c} | `{t}` | {o} | {_cell(d)} |" for c, t, o, d in rows]
    measured = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if (
        metrics and metrics.exists()) else []
    if measured:
        out += ["", "## Measured", "", "| what | value | note |", "| --- | --- | --- |"]
        for m in measured:
            value = f"{m['value']} {m['unit']}".strip()
            out.append(f"| {_cell(m['name'])} | {_cell(value)} | {_cell(m['note'])} |")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--junit", type=Path)
    parser.add_argument("--metrics", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--skipped", help="write a report that says the checks were skipped, and why")
    args = parser.parse_args()
    text = render(args.junit, args.metrics, args.skipped)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
