"""DiskOffloadAdamW: bitwise torch AdamW(fused=True), moments out of process memory, state round trip."""

from __future__ import annotations

import copy
import sys

import pytest
import torch

from rlite.training.optim_offload import DiskOffloadAdamW


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    # 300 x 700 = 210k elements: several 4096-element chunks and a partial last one
    return torch.nn.Sequential(torch.nn.Linear(300, 700), torch.nn.ReLU(), torch.nn.Linear(700, 5))


def _set_grads(model: torch.nn.Module, step: int, skip: str | None = None) -> None:
    for name, p in model.named_parameters():
        g = torch.Generator().manual_seed(1000 * step + p.numel())
        p.grad = None if name == skip else torch.randn(p.shape, generator=g) * (1 + step)


def _run(reference, offloaded, ref_opt, off_opt, steps, first=0):
    for step in range(first, first + steps):
        skip = "2.bias" if step == 1 else None  # a parameter without a gradient is left alone by both
        for model, opt in ((reference, ref_opt), (offloaded, off_opt)):
            _set_grads(model, step, skip)
            for group in opt.param_groups:
                group["lr"] = 1e-2 / (step + 1)  # what an LR scheduler does
            opt.step()


def _equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("direct_io", [None, False], ids=["direct-where-possible", "buffered"])
def test_steps_are_bitwise_torch_fused_adamw(tmp_path, direct_io):
    """Many small chunks (4096 elements) through 3 staging buffers: reads, steps and writes overlap."""
    reference, offloaded = _model(), _model()
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(reference.parameters(), **kw, fused=True)
    off_opt = DiskOffloadAdamW(offloaded.parameters(), tmp_path / "moments", **kw, chunk_mb=0.05,
                               direct_io=direct_io)
    assert off_opt.chunk == 4096
    if direct_io is False:
        assert not off_opt.direct_io
    _run(reference, offloaded, ref_opt, off_opt, steps=4)
    assert _equal(reference, offloaded)
    ref_sd, off_sd = ref_opt.state_dict(), off_opt.state_dict()
    for ref_group, off_group in zip(ref_sd["param_groups"], off_sd["param_groups"]):
        assert {k: ref_group[k] for k in off_group} == off_group
    for index, ref_state in ref_sd["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(ref_state[key], off_sd["state"][index][key]), (index, key)
    off_opt.close()


def test_state_dict_round_trip_continues_bitwise(tmp_path):
    """A checkpointed optimizer loaded into a fresh one (and a plain AdamW's state loaded into an
    offloaded one) continues exactly like the uninterrupted reference."""
    reference, offloaded = _model(), _model()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    off_opt = DiskOffloadAdamW(offloaded.parameters(), tmp_path / "a", lr=1e-2, weight_decay=0.1)
    _run(reference, offloaded, ref_opt, off_opt, steps=2)
    saved = copy.deepcopy(off_opt.state_dict())
    off_opt.close()
    assert not (tmp_path / "a").exists(), "close() deletes the scratch files"

    resumed = DiskOffloadAdamW(offloaded.parameters(), tmp_path / "b", lr=1e-2, weight_decay=0.1)
    resumed.load_state_dict(saved)
    # the loaded moments live in the files, not in the loaded copies
    state = resumed.state[next(offloaded.parameters())]
    assert state["exp_avg"].data_ptr() == resumed._files[id(next(offloaded.parameters()))].exp_avg.data_ptr()
    _run(reference, offloaded, ref_opt, resumed, steps=2, first=2)
    assert _equal(reference, offloaded)

    from_plain = _model()
    from_plain.load_state_dict(reference.state_dict())
    switched = DiskOffloadAdamW(from_plain.parameters(), tmp_path / "c", lr=1e-2, weight_decay=0.1)
    switched.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    _run(reference, from_plain, ref_opt, switched, steps=1, first=4)
    assert _equal(reference, from_plain)
    resumed.close()
    switched.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_moments_do_not_stay_in_process_memory(tmp_path):
    def rss_bytes() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    n = 16 * 2**20  # 64 MiB of fp32 weights: 128 MiB of moments
    param = torch.nn.Parameter(torch.zeros(n))
    param.grad = torch.ones(n)
    opt = DiskOffloadAdamW([param], tmp_path / "moments", lr=1e-3, weight_decay=0.0, chunk_mb=8)
    before = rss_bytes()
    for _ in range(2):
        opt.step()
    opt.wait()
    grown = rss_bytes() - before
    assert grown < 32 * 2**20, f"process memory grew by {grown / 2**20:.0f} MiB over 128 MiB of moments"
    # the moments are real: AdamW's first step moves every weight by lr (m_hat / sqrt(v_hat) = 1)
    assert torch.allclose(param.detach(), torch.full((n,), -2e-3), rtol=1e-5)
    assert opt.state_dict()["state"][0]["exp_avg"].sum().item() == pytest.approx(0.19 * n, rel=1e-5)
    opt.close()


def test_unwritable_folder_names_the_config_key(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OSError, match="training.optimizer_offload_dir"):
        DiskOffloadAdamW([torch.nn.Parameter(torch.zeros(3))], blocker / "moments")


def test_non_fp32_parameters_are_refused(tmp_path):
    param = torch.nn.Parameter(torch.zeros(8, dtype=torch.bfloat16))
    param.grad = torch.ones_like(param)
    opt = DiskOffloadAdamW([param], tmp_path / "moments")
    with pytest.raises(TypeError, match="fp32 parameters"):
        opt.step()
    opt.close()


def test_empty_shard_gets_state_and_steps(tmp_path):
    """An FSDP2 rank can hold an empty shard of a small parameter: it still gets (empty) moments."""
    empty, full = torch.nn.Parameter(torch.zeros(0)), torch.nn.Parameter(torch.zeros(5))
    empty.grad, full.grad = torch.zeros(0), torch.ones(5)
    opt = DiskOffloadAdamW([empty, full], tmp_path / "moments", lr=1e-3, weight_decay=0.0)
    opt.step()
    state = opt.state_dict()["state"]
    assert state[0]["exp_avg"].numel() == 0 and state[0]["step"].item() == 1
    assert torch.allclose(full.detach(), torch.full((5,), -1e-3))
    opt.close()


def test_full_disk_is_reported_before_any_write(tmp_path, monkeypatch):
    """The moment files' blocks are reserved when they are created: a full disk is a clear error then,
    not a SIGBUS at a later write into the mapping."""
    import errno
    import os

    if not hasattr(os, "posix_fallocate"):
        pytest.skip("no posix_fallocate on this system")

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    param = torch.nn.Parameter(torch.zeros(10))
    param.grad = torch.ones(10)
    opt = DiskOffloadAdamW([param], tmp_path / "moments")
    with pytest.raises(OSError, match="training.optimizer_offload_dir: cannot reserve"):
        opt.step()
    assert torch.equal(param.detach(), torch.zeros(10)), "nothing was stepped"


@pytest.mark.parametrize("fail", ["read", "write"])
def test_io_failure_is_an_error_not_a_hang(tmp_path, monkeypatch, fail):
    """A failing read or write of a chunk stops the step with an error naming the folder; the
    pipeline's threads end."""
    import threading

    from rlite.training import optim_offload

    model = _model()
    _set_grads(model, 0)
    opt = DiskOffloadAdamW(model.parameters(), tmp_path / "moments", chunk_mb=0.05)
    calls = []
    original = getattr(optim_offload._MomentFile, fail)

    def flaky(self, *args):
        calls.append(1)
        if len(calls) == 5:
            raise OSError(5, "Input/output error")
        return original(self, *args)

    monkeypatch.setattr(optim_offload._MomentFile, fail, flaky)
    with pytest.raises(OSError, match="moments.*Input/output error"):
        opt.step()
    assert not [t for t in threading.enumerate() if t.name.startswith("rlite-optimizer-")]
    opt.close()
