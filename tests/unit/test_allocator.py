"""keep_freed_memory: a training step's large tensors reuse the last step's memory (no page faults)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rlite.run.allocator import _glibc

PROBE = r"""
import json, resource, sys
import torch
torch.set_num_threads(1)
if sys.argv[1] == "keep":
    from rlite.run.allocator import keep_freed_memory
    assert keep_freed_memory()

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

def step():  # a training step's pattern: activations kept for backward, their gradients, then all freed
    saved = [torch.ones(n << 20) for n in (16, 40, 8, 24)]  # 88 M floats, 352 MiB
    grads = [torch.ones_like(t) for t in reversed(saved)]
    del saved, grads

counts = []
for _ in range(10):
    before = faults()
    step()
    counts.append(faults() - before)
print(json.dumps(counts))
"""


def minor_faults_per_step(mode: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(_glibc() is None, reason="glibc only")
def test_steps_reuse_freed_memory_without_page_faults():
    pages_per_step = 2 * (88 << 20) * 4 // 4096  # every page of the step's tensors, touched once
    default, kept = minor_faults_per_step("default"), minor_faults_per_step("keep")
    # glibc's default maps every large block afresh and unmaps it on free: each step faults them all in
    assert all(count > 0.9 * pages_per_step for count in default)
    # kept: once the heap has grown to the step's size, steps reuse it; where a small allocation
    # splits a freed block the heap grows a little more, so a later step can still fault some pages
    assert kept[0] > 0.9 * pages_per_step
    assert sum(kept[1:]) < 0.25 * sum(default[1:]), kept
