"""The run folder's config.yaml is replaced whole: while the main rank writes this run's config, another
rank checks the resumed checkpoint against the old one (``check_resume_config``) and must read it whole.

Found by a fresh-clone test run under load: rank 1 of a resumed two-rank run read the file while rank 0
rewrote it in place, saw a file cut short (an empty config) and stopped with "written by a run with
another model or algorithm" (exit 2)."""

from __future__ import annotations

from pathlib import Path

from rlite.config import config_to_yaml
from rlite.run.build import write_run_config
from rlite.run.lifecycle import check_resume_config
from rlite.testing import tiny_config
from rlite.tokenizer import build_tiny_model_dir


def test_a_reader_during_the_write_sees_the_old_file_whole_then_the_new(tmp_path, monkeypatch):
    import os

    import rlite.run_files as run_files

    run_dir = tmp_path / "run"
    old_text, new_text = "model: {path: old}\n" * 200, "model: {path: new}\n" * 200
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(old_text)
    seen = []
    fdopen = os.fdopen

    class SlowWrite:  # a reader looks in the middle of the write
        def __init__(self, handle) -> None:
            self.handle = handle

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def write(self, data):
            self.handle.write(data[: len(data) // 2])
            self.handle.flush()
            seen.append((run_dir / "config.yaml").read_text())
            return self.handle.write(data[len(data) // 2 :])

    monkeypatch.setattr(run_files.os, "fdopen", lambda *args, **kwargs: SlowWrite(fdopen(*args, **kwargs)))
    write_run_config(run_dir, new_text)
    assert seen == [old_text]
    assert (run_dir / "config.yaml").read_text() == new_text
    assert [p.name for p in run_dir.iterdir()] == ["config.yaml"]  # no temporary file left


def test_the_resume_check_passes_against_the_config_the_run_wrote(tmp_path):
    model_dir = build_tiny_model_dir(tmp_path / "model", hidden=16, layers=1)
    cfg = tiny_config(model_dir, tmp_path / "run")
    run_dir = Path(cfg.logging.run_dir)
    (run_dir / "checkpoints" / "step_00000001").mkdir(parents=True)
    write_run_config(run_dir, config_to_yaml(cfg))
    check_resume_config(cfg, run_dir / "checkpoints" / "step_00000001")  # no ConfigError
