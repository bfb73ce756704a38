"""Fault campaign: inject each kind of fault at random over N trials of a tiny run and count what held.

Fault kinds (each trial a few seconds on a ~0.2M-parameter model, 4 steps):

* ``sigkill``: ``rlite train`` in a subprocess, SIGKILLed at a random moment, then the same command
  again (``checkpoint.every=1``, ``resume: auto``).
* ``sigterm``: the same, SIGTERM instead (``checkpoint.every=0``: the only checkpoint is the one the
  signal makes at a step boundary); the first run must exit 75.
* ``nan``: a NaN reward at a random step (an ``after_rewards`` hook): its update must be skipped and
  the run go on (no bitwise comparison: one update fewer is the intended outcome).
* ``engine_kill``: the spawned transformers engine SIGKILLed after the rollout or the weight sync of
  a random step; the run must restart it and go on.
* ``corrupt_latest``: one random byte of one random file of the latest of two checkpoints flipped;
  ``resume: auto`` must fall back to the previous one.
* ``torn_log``: the last line of ``metrics.jsonl`` cut at a random byte (what a crash or a full disk
  mid-write leaves), NUL bytes after it in half the trials; the resume must drop it and finish.
* ``malicious_checkpoint``: a pickled call (``exec``, ``os.system`` or ``eval``, each creating a marker
  file) planted in the latest checkpoint's trainer state or DCP ``.metadata``, its manifest rewritten to
  match; ``rlite train`` must refuse it (status 2, the file named), run nothing and leave the run's files
  as they were ("survived"; "data lost": the marker exists or a file of the run changed).
* ``disk_full``: ENOSPC at a random write path (metrics.jsonl, TensorBoard, samples.jsonl, a checkpoint's
  ``torch.save``, the export) at a random step of ``rlite train`` (``rlite.tools.cli.main``, in this process): it
  must exit 4 naming the free space, and the same command again must finish (``checkpoint.every=1``).
* ``engine_start_death``: the spawned engine process SIGKILLed before it is ready: the first engine once or
  twice, or (after the running engine was killed at a random step) its replacement once; the run must start
  it again and go on (``rollout.engine_restarts=2``).
* ``engine_exhausted``: the spawned engine SIGKILLed during the policy update of a random step with
  ``rollout.engine_restarts=0``: ``rlite train`` must stop with status 4 having written that step's metrics row
  before its checkpoint (the rows are counted), and the same command again must finish.
* ``code_in_config``: a run folder whose ``config.yaml`` names a ``python`` reward file, or a model folder with
  remote code and ``trust_remote_code: true``, each creating a marker file when imported, given to ``rlite chat``,
  ``rlite generate`` or ``rlite info`` (its export or its checkpoint): the command must succeed and nothing run
  ("data lost": the marker exists or a file of the run changed).
* ``linked_files``: a run folder where ``metrics.jsonl``, ``samples.jsonl`` or ``config.yaml`` is a symbolic link
  to a file outside it, or the latest checkpoint's shard or folder is, resumed by ``rlite train``; or whose
  ``hf_model`` is, given to ``rlite chat``: refused (status 2) naming the link, the file it points to unchanged
  ("data lost": it changed).
* ``malformed_state``: the latest checkpoint's trainer state replaced by data that is no trainer state (a view past
  its storage, a list 200,000 deep, an int; ``rlite.testing.write_malformed_trainer_state``) under a manifest that
  vouches for it: ``rlite chat`` must refuse it (status 2, naming the file) and ``rlite train`` resume from the
  checkpoint before and finish.

Columns: ``injected`` trials where the fault hit a running run; ``survived`` the run (and its resume)
finished every step; ``resumed bitwise`` its final weights equal an undisturbed run's bit for bit;
``data lost`` trials whose metrics file lacks a step's row or has one twice, or that ended without
the final weights. Run: ``python benchmarks/fault_campaign.py --trials 20`` (under the bench lock on a
shared machine).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from rlite import hookimpl

STEPS = 4
KINDS = ("sigkill", "sigterm", "nan", "engine_kill", "corrupt_latest", "torn_log", "malicious_checkpoint",
         "disk_full", "engine_start_death", "engine_exhausted", "code_in_config", "linked_files", "malformed_state")


def base_args(model_dir: str, run_dir: Path, *extra: str) -> list[str]:
    return [
        f"model.path={model_dir}", "data.task=addition", "data.num_train=64", "data.num_eval=8",
        "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=4",
        "training.micro_batch_size=8", "training.lr=1e-2", f"training.steps={STEPS}", "training.eval_every=0",
        f"logging.run_dir={run_dir}", "logging.progress_bar=false", "logging.plot=false", "logging.loggers=[jsonl]",
        "checkpoint.export_hf=true", "checkpoint.resume=auto", *extra,
    ]  # fmt: skip


def env() -> dict[str, str]:
    from rlite.testing import run_in_subprocess_env

    return run_in_subprocess_env()


def cli(config: Path, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "rlite", "train", str(config), *args]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor] | None:
    from safetensors.torch import load_file

    path = run_dir / "hf_model" / "model.safetensors"
    return load_file(path) if path.is_file() else None


def same(a, b) -> bool:
    return a is not None and b is not None and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def rows_exact(run_dir: Path) -> bool:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return False
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = [row["step"] for row in rows if "provenance" not in row]  # each session's provenance record is not a step
    return steps == list(range(STEPS + 1))


def in_process(model_dir: str, run_dir: Path, plugin=None, *extra: str):
    from rlite.config import load_config
    from rlite.plugin_manager import build_plugin_manager
    from rlite.run.loop import run_training

    pm = build_plugin_manager(autoload=False)
    if plugin is not None:
        pm.register(plugin, name="fault")
    return run_training(load_config(None, base_args(model_dir, run_dir, *extra), pm=pm), pm)


# -- the faults -----------------------------------------------------------------------------------


def signal_trial(sig: int, rng: random.Random, work: Path, config: Path, model_dir: str, reference, duration: float):
    run_dir = work / "run"
    extra = ["checkpoint.every=1"] if sig == signal.SIGKILL else ["checkpoint.every=0"]
    cmd = cli(config, base_args(model_dir, run_dir, *extra))
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(rng.uniform(0.5, duration))
    injected = proc.poll() is None
    if injected:
        proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=600)
    first_ok = proc.returncode == 0 or (sig == signal.SIGKILL and proc.returncode == -9) or (
        sig == signal.SIGTERM and proc.returncode == 75)
    done = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=600)
    survived = first_ok and done.returncode == 0
    if not survived:
        print(f"  [{signal.Signals(sig).name}] first exit {proc.returncode}, resume exit {done.returncode}: "
              f"{(stderr + done.stderr)[-400:]!r}", file=sys.stderr)  # fmt: skip
    weights = final_weights(run_dir)
    return injected, survived, same(weights, reference), not (rows_exact(run_dir) and weights is not None)


class NanReward:
    def __init__(self, step: int):
        self.step = step

    @hookimpl
    def after_rewards(self, step, batch):
        if step == self.step:
            batch.scores[0] = float("nan")


def nan_trial(rng, work, config, model_dir, reference, duration):
    run_dir = work / "run"
    step = rng.randint(1, STEPS)
    try:
        in_process(model_dir, run_dir, NanReward(step), "checkpoint.every=0")
        survived = True
    except Exception as exc:  # noqa: BLE001 (a campaign counts failures)
        print(f"  [nan] {type(exc).__name__}: {exc}", file=sys.stderr)
        survived = False
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    skipped = [r["step"] for r in rows if r.get("train/skipped_nonfinite")]
    weights = final_weights(run_dir)
    finite = weights is not None and all(torch.isfinite(t).all() for t in weights.values())
    return True, survived and skipped == [step] and finite, None, not (rows_exact(run_dir) and finite)


class EngineKiller:
    def __init__(self, step: int, after_sync: bool):
        self.step, self.kill_after_sync, self.engine = step, after_sync, None

    @hookimpl
    def after_weight_sync(self, step, engine):
        self.engine = engine
        if self.kill_after_sync and step == self.step:
            os.kill(engine.pid, signal.SIGKILL)

    @hookimpl
    def after_rollout(self, step):
        if not self.kill_after_sync and step == self.step:
            os.kill(self.engine.pid, signal.SIGKILL)


ENGINE = ("rollout.engine.args.process=true", "rollout.timeout_s=120", "checkpoint.every=0")


def engine_trial(rng, work, config, model_dir, reference, duration):
    run_dir = work / "run"
    after_sync = rng.random() < 0.5
    # after a rollout: from step 2, once a sync has shown the hook the engine
    killer = EngineKiller(rng.randint(1 if after_sync else 2, STEPS - 1), after_sync)
    try:
        in_process(model_dir, run_dir, killer, *ENGINE)
        survived = True
    except Exception as exc:  # noqa: BLE001
        print(f"  [engine_kill] {type(exc).__name__}: {exc}", file=sys.stderr)
        survived = False
    weights = final_weights(run_dir)
    return True, survived, same(weights, reference), not (rows_exact(run_dir) and weights is not None)


def corrupt_trial(rng, work, config, model_dir, reference, duration, prepared: Path):
    from rlite.run.checkpoint import list_checkpoints

    run_dir = work / "run"
    shutil.copytree(prepared, run_dir)
    latest = list_checkpoints(run_dir / "checkpoints")[-1]
    files = sorted(p for p in latest.rglob("*") if p.is_file() and p.name != "COMPLETE")
    victim = rng.choice(files)
    data = bytearray(victim.read_bytes())
    data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    victim.write_bytes(bytes(data))
    try:
        in_process(model_dir, run_dir, None, "checkpoint.every=1")
        survived = True
    except Exception as exc:  # noqa: BLE001
        print(f"  [corrupt_latest] {victim.name}: {type(exc).__name__}: {exc}", file=sys.stderr)
        survived = False
    weights = final_weights(run_dir)
    return True, survived, same(weights, reference), not (rows_exact(run_dir) and weights is not None)


def torn_log_trial(rng, work, config, model_dir, reference, duration, prepared: Path):
    run_dir = work / "run"
    shutil.copytree(prepared, run_dir)
    metrics = run_dir / "metrics.jsonl"
    last = metrics.read_text().splitlines()[-1]
    row = json.loads(last)
    torn = json.dumps(dict(row, step=row["step"] + 1))  # the row of the step the crash interrupted
    tail = torn[: rng.randrange(1, len(torn))].encode() + (b"\0" * rng.randrange(1, 4096) if rng.random() < 0.5 else b"")
    with open(metrics, "ab") as handle:
        handle.write(tail)
    try:
        in_process(model_dir, run_dir, None, "checkpoint.every=1")
        survived = True
    except Exception as exc:  # noqa: BLE001
        print(f"  [torn_log] {tail[:40]!r}: {type(exc).__name__}: {exc}", file=sys.stderr)
        survived = False
    weights = final_weights(run_dir)
    return True, survived, same(weights, reference), not (rows_exact(run_dir) and weights is not None)


class patched:
    """Set ``owner.name`` to ``value`` for a ``with`` block."""

    def __init__(self, owner, name: str, value):
        self.owner, self.name, self.value = owner, name, value

    def __enter__(self):
        self.saved = getattr(self.owner, self.name)
        setattr(self.owner, self.name, self.value)

    def __exit__(self, *exc):
        setattr(self.owner, self.name, self.saved)


DISK_FULL_PATHS = ("metrics", "tensorboard", "samples", "checkpoint", "export")


def full_disk_writer(path: str, step: int):
    """``(owner, attribute, replacement)``: the writer of ``path`` failing as a full disk does from ``step`` on."""
    import errno

    from transformers import PreTrainedModel

    from rlite.plugins.loggers import JsonlLogger, TensorBoardLogger
    from rlite.samples import SampleWriter

    def enospc(self, at_step, *args, **kwargs):
        if at_step >= step:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, at_step, *args, **kwargs)

    if path in ("metrics", "tensorboard", "samples"):
        owner, name = {"metrics": (JsonlLogger, "log"), "tensorboard": (TensorBoardLogger, "log"),
                       "samples": (SampleWriter, "write")}[path]  # fmt: skip
        original = getattr(owner, name)
        return owner, name, enospc
    if path == "checkpoint":  # torch.save's zip writer reports ENOSPC without the errno
        save = torch.save

        def failing_save(obj, f, *args, **kwargs):
            if f"step_{step:08d}" in str(f):
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
            return save(obj, f, *args, **kwargs)

        return torch, "save", failing_save

    def config_then_full(self, save_directory, *args, **kwargs):
        Path(save_directory).mkdir(parents=True, exist_ok=True)
        self.config.save_pretrained(save_directory)
        raise OSError(errno.ENOSPC, "No space left on device")

    return PreTrainedModel, "save_pretrained", config_then_full


def disk_full_trial(rng, work, config, model_dir, reference, duration):
    import contextlib
    import io

    from rlite.tools.cli import main as rlite_main

    run_dir = work / "run"
    path, step = rng.choice(DISK_FULL_PATHS), rng.randint(1, STEPS)
    argv = ["train", str(config), *base_args(model_dir, run_dir, "checkpoint.every=1", "logging.samples_every=1",
                                             "logging.loggers=[jsonl,tensorboard]")]  # fmt: skip
    stderr = io.StringIO()
    with patched(*full_disk_writer(path, step)), contextlib.redirect_stderr(stderr):
        first = rlite_main(argv)
    message = stderr.getvalue()
    injected = first == 4
    named = "GiB free of" in message and "Free disk space" in message and "run the same command again" in message
    with contextlib.redirect_stderr(io.StringIO()) as again:
        second = rlite_main(argv)
    survived = injected and named and second == 0
    if not survived:
        print(f"  [disk_full {path} step {step}] first exit {first}, then {second}: {message[-400:]!r} "
              f"{again.getvalue()[-400:]!r}", file=sys.stderr)  # fmt: skip
    weights = final_weights(run_dir)
    leftovers = (run_dir / "hf_model.tmp").exists()
    return injected, survived and not leftovers, same(weights, reference), not (rows_exact(run_dir) and weights is not None)


class DiesWhileStarting:
    """The spawned ``transformers`` engine, except that the starts numbered in ``deaths`` are SIGKILLed
    before the engine process is ready."""

    def __init__(self, deaths: set[int]):
        self.deaths, self.starts = deaths, 0

    @hookimpl
    def register_rollout_engines(self, register):
        import functools

        from rlite.plugins.transformers import TransformersEngineConfig, make_transformers_engine
        from rlite.plugins.transformers.process import ProcessEngine

        def make(model_config, tokenizer, rollout_config, cfg, context):
            self.starts += 1
            if self.starts in self.deaths:
                return ProcessEngine(model_config.path, pad_token_id=0, eos_token_ids=[0], timeout_s=120,
                                     engine_factory=functools.partial(signal.raise_signal, signal.SIGKILL),
                                     factory_kwargs={})  # fmt: skip
            return make_transformers_engine(model_config, tokenizer, rollout_config, cfg, context)

        register("dies_while_starting", make, TransformersEngineConfig)


def engine_start_trial(rng, work, config, model_dir, reference, duration):
    from rlite.config import load_config
    from rlite.plugin_manager import build_plugin_manager
    from rlite.run.loop import run_training

    run_dir = work / "run"
    replacement = rng.random() < 0.5
    # the first engine dies once or twice while starting; or the running one is killed and its replacement dies
    deaths = {2} if replacement else set(range(1, rng.randint(1, 2) + 1))
    pm = build_plugin_manager(autoload=False)
    starting = DiesWhileStarting(deaths)
    pm.register(starting, name="dies_while_starting")
    if replacement:
        pm.register(EngineKiller(rng.randint(1, STEPS - 1), after_sync=True), name="killer")
    # the engine's name first: naming another implementation forgets the args given before it
    args = base_args(model_dir, run_dir, "rollout.engine.name=dies_while_starting", *ENGINE, "rollout.engine_restarts=2")
    try:
        run_training(load_config(None, args, pm=pm), pm)
        survived = starting.starts == len(deaths) + 1 + int(replacement)
    except Exception as exc:  # noqa: BLE001
        print(f"  [engine_start_death {sorted(deaths)}] {type(exc).__name__}: {exc}", file=sys.stderr)
        survived = False
    weights = final_weights(run_dir)
    return True, survived, same(weights, reference), not (rows_exact(run_dir) and weights is not None)


class Payload:
    """Unpickling it calls ``call`` (by reference: ``builtins.exec``, ``posix.system``, ``builtins.eval``)."""

    def __init__(self, call, argument: str) -> None:
        self.call, self.argument = call, argument

    def __reduce__(self):
        return self.call, (self.argument,)


def malicious_trial(rng, work, config, model_dir, reference, duration, prepared: Path):
    import contextlib
    import io
    import pickle

    from rlite.run.checkpoint import list_checkpoints
    from rlite.testing import rewrite_manifest
    from rlite.tools.cli import main as rlite_main

    run_dir = work / "run"
    shutil.copytree(prepared, run_dir)
    latest = list_checkpoints(run_dir / "checkpoints")[-1]
    marker = work / "code-ran"
    call, argument = rng.choice([(exec, f"open({str(marker)!r}, 'w').close()"), (os.system, f"touch '{marker}'"),
                                 (eval, f"open({str(marker)!r}, 'w')")])  # fmt: skip
    if rng.random() < 0.5:
        victim = latest / "trainer_state_rank0.pt"
        state = torch.load(victim, weights_only=False)  # the campaign's own file
        state[rng.choice(["sampler", "kl_controller", "scheduler"])] = Payload(call, argument)
        torch.save(state, victim)
    else:
        victim = latest / ".metadata"
        metadata = pickle.loads(victim.read_bytes())  # the campaign's own file
        metadata.planner_data = Payload(call, argument)
        victim.write_bytes(pickle.dumps(metadata))
    rewrite_manifest(latest)  # it vouches for the payload, in rlite's own scheme
    before = {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        status = rlite_main(["train", str(config), *base_args(model_dir, run_dir, "checkpoint.every=1")])
    after = {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}
    refused = status == 2 and str(victim) in stderr.getvalue() and "nothing was executed" in stderr.getvalue()
    if not refused or marker.exists():
        print(f"  [malicious_checkpoint] {victim.name}, {call.__name__}: status {status}, marker "
              f"{marker.exists()}: {stderr.getvalue()[-300:]!r}", file=sys.stderr)  # fmt: skip
    return True, refused and not marker.exists(), None, marker.exists() or before != after


class KilledDuringTheUpdate:
    """SIGKILLs the spawned engine once the policy update of ``step`` is done (its death shows at the sync)."""

    def __init__(self, step: int):
        self.step, self.engine = step, None

    @hookimpl
    def after_weight_sync(self, step, engine):
        self.engine = engine

    @hookimpl
    def after_optimizer_step(self, step, model, metrics):
        if step == self.step:
            os.kill(self.engine.pid, signal.SIGKILL)


def metric_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    return [row["step"] for row in rows if "provenance" not in row]


def engine_exhausted_trial(rng, work, config, model_dir, reference, duration):
    from rlite.config import load_config
    from rlite.plugin_manager import build_plugin_manager
    from rlite.run.faults import RunStopped
    from rlite.run.loop import run_training

    run_dir = work / "run"
    step = rng.randint(2, STEPS - 1)  # from step 2: a sync has shown the hook the engine
    pm = build_plugin_manager(autoload=False)
    pm.register(KilledDuringTheUpdate(step), name="killer")
    args = base_args(model_dir, run_dir, *ENGINE, "rollout.engine_restarts=0", "checkpoint.resume=auto")
    try:
        run_training(load_config(None, args, pm=pm), pm)
        stopped, rows_at_stop = None, metric_steps(run_dir)
    except RunStopped as exc:
        stopped, rows_at_stop = exc, metric_steps(run_dir)
    injected = stopped is not None and stopped.exit_code == 4
    # the checkpoint of `step` came with its row: the stop left rows 0..step, exactly
    rows_ok = rows_at_stop == list(range(step + 1))
    try:
        in_process(model_dir, run_dir, None, *ENGINE)
        resumed = True
    except Exception as exc:  # noqa: BLE001
        print(f"  [engine_exhausted step {step}] resume: {type(exc).__name__}: {exc}", file=sys.stderr)
        resumed = False
    if not (injected and rows_ok):
        print(f"  [engine_exhausted step {step}] stop {stopped!r}, rows at the stop {rows_at_stop}", file=sys.stderr)
    weights = final_weights(run_dir)
    lost = not (rows_ok and rows_exact(run_dir) and weights is not None)
    return injected, injected and rows_ok and resumed, same(weights, reference), lost


EVIL_REWARD = "open({marker!r}, 'w').close()\n\n\ndef score(completion, sample):\n    return 0.0\n"
EVIL_MODEL = """open({marker!r}, "w").close()
from transformers import Qwen2Config, Qwen2ForCausalLM


class EvilConfig(Qwen2Config):
    pass


class EvilModel(Qwen2ForCausalLM):
    config_class = EvilConfig
"""


def folder_files(run_dir: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file() and not p.is_symlink()}


def quietly(argv: list[str], stdin: str = "") -> tuple[int, str]:
    """``rlite.tools.cli.main(argv)`` in this process with ``stdin``; its status and stderr."""
    import contextlib
    import io

    from rlite.tools.cli import main as rlite_main

    err = io.StringIO()
    saved = sys.stdin
    sys.stdin = io.StringIO(stdin)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            status = rlite_main(argv)
    finally:
        sys.stdin = saved
    return status, err.getvalue()


def code_in_config_trial(rng, work, config, model_dir, reference, duration, prepared: Path):
    import yaml

    run_dir = work / "run"
    shutil.copytree(prepared, run_dir)
    marker = work / "code-ran"
    payload = rng.choice(["python reward", "remote model code"])
    settings = yaml.safe_load((run_dir / "config.yaml").read_text())
    if payload == "python reward":
        (run_dir / "evil.py").write_text(EVIL_REWARD.format(marker=str(marker)))
        settings["rewards"] = [{"name": "python", "args": {"function": f"{run_dir / 'evil.py'}:score"}}]
    else:
        model = run_dir / "model"
        shutil.copytree(model_dir, model)
        (model / "evil_model.py").write_text(EVIL_MODEL.format(marker=str(marker)))
        hf = json.loads((model / "config.json").read_text())
        hf["auto_map"] = {"AutoConfig": "evil_model.EvilConfig", "AutoModelForCausalLM": "evil_model.EvilModel"}
        (model / "config.json").write_text(json.dumps(hf))
        settings["model"].update(path=str(model), trust_remote_code=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(settings))
    if rng.random() < 0.5:  # its checkpoint, turned into a model by the training backend, instead of its export
        shutil.rmtree(run_dir / "hf_model")
    command = rng.choice(["chat", "generate", "info"])
    prompts = work / "prompts.txt"
    prompts.write_text("12+3=\n")
    argv = {"chat": ["chat", str(run_dir), "--max-new-tokens", "2"], "info": ["info", str(run_dir)],
            "generate": ["generate", str(run_dir), "--prompts", str(prompts), "--out", str(work / "out.jsonl"),
                         "--max-new-tokens", "2"]}[command]  # fmt: skip
    before = folder_files(run_dir)
    status, err = quietly(argv, "12+3=\n")
    ran = marker.exists()
    if status != 0 or ran:
        print(f"  [code_in_config {payload}, {command}] status {status}, marker {ran}: {err[-300:]!r}", file=sys.stderr)
    return True, status == 0 and not ran, None, ran or folder_files(run_dir) != before


LINKED = ("metrics.jsonl", "samples.jsonl", "config.yaml", "checkpoint shard", "checkpoint folder", "hf_model")


def linked_files_trial(rng, work, config, model_dir, reference, duration, prepared: Path):
    from rlite.run.checkpoint import list_checkpoints

    run_dir = work / "run"
    shutil.copytree(prepared, run_dir)
    what = rng.choice(LINKED)
    latest = list_checkpoints(run_dir / "checkpoints")[-1]
    target = work / "outside"
    if what in ("metrics.jsonl", "samples.jsonl", "config.yaml"):  # someone's file: the resume must not touch it
        link = run_dir / what
        target.write_text("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKeyKeyKeyKeyKeyKeyKeyKey user@host\n")
        link.unlink()
    else:  # the run's own data moved out and linked back: it loaded silently
        link = {"checkpoint shard": latest / "__0_0.distcp", "checkpoint folder": latest,
                "hf_model": run_dir / "hf_model"}[what]  # fmt: skip
        shutil.move(link, target)
    link.symlink_to(target)
    before = target.read_bytes() if target.is_file() else folder_files(target)
    if what == "hf_model":
        status, err = quietly(["chat", str(run_dir), "--max-new-tokens", "2"], "12+3=\n")
    else:
        status, err = quietly(["train", str(config), *base_args(model_dir, run_dir, "checkpoint.every=1")])
    after = target.read_bytes() if target.is_file() else folder_files(target)
    refused = status == 2 and f"{link} is a symbolic link to {target}" in err
    if not refused:
        print(f"  [linked_files {what}] status {status}: {err[-300:]!r}", file=sys.stderr)
    return True, refused and before == after, None, before != after


def malformed_state_trial(rng, work, config, model_dir, reference, duration, prepared: Path):
    from rlite.run.checkpoint import list_checkpoints
    from rlite.testing import MALFORMED_TRAINER_STATES, rewrite_manifest, write_malformed_trainer_state

    run_dir = work / "run"
    shutil.copytree(prepared, run_dir)  # no export: chat turns the latest checkpoint into the model
    kind = rng.choice(MALFORMED_TRAINER_STATES)
    latest = list_checkpoints(run_dir / "checkpoints")[-1]
    write_malformed_trainer_state(latest / "trainer_state_rank0.pt", kind)
    rewrite_manifest(latest)
    chat, chat_err = quietly(["chat", str(run_dir), "--max-new-tokens", "2"], "12+3=\n")
    chat_refused = chat == 2 and f"{latest} is damaged: trainer_state_rank0.pt" in chat_err
    try:
        in_process(model_dir, run_dir, None, "checkpoint.every=1")
        survived = chat_refused
    except Exception as exc:  # noqa: BLE001
        print(f"  [malformed_state {kind}] {type(exc).__name__}: {exc}", file=sys.stderr)
        survived = False
    if not chat_refused:
        print(f"  [malformed_state {kind}] chat status {chat}: {chat_err[-300:]!r}", file=sys.stderr)
    weights = final_weights(run_dir)
    return True, survived, same(weights, reference), not (rows_exact(run_dir) and weights is not None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20, help="trials per fault kind (default 20)")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated subset of {','.join(KINDS)}")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    import logging

    from rlite.tokenizer import build_tiny_model_dir

    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="rlite-faults-"))
    model_dir = str(build_tiny_model_dir(root / "tiny"))
    config = root / "run.yaml"
    config.write_text("training:\n  seed: 0\n")
    # undisturbed references: the in-process engine (subprocess runs, the NaN trials) and the spawned one
    start = time.perf_counter()
    subprocess.run(cli(config, base_args(model_dir, root / "ref")), env=env(), check=True, capture_output=True)
    duration = time.perf_counter() - start
    reference = final_weights(root / "ref")
    in_process(model_dir, root / "ref_engine", None, *ENGINE)
    reference_engine = final_weights(root / "ref_engine")
    print(f"in-process and spawned engines train bitwise alike: {same(reference, reference_engine)}", file=sys.stderr)
    prepared = root / "prepared"  # two checkpoints (steps 2 and 3) to corrupt the latest of
    in_process(model_dir, prepared, None, "checkpoint.every=1", "checkpoint.keep_last=2", "training.steps=3",
               "checkpoint.export_hf=false")  # fmt: skip
    shutil.rmtree(prepared / "hf_model", ignore_errors=True)
    exported = root / "exported"  # a finished run folder with its export and samples, for chat, generate, info
    in_process(model_dir, exported, None, "checkpoint.every=1", "checkpoint.keep_last=2", "training.steps=3",
               "logging.samples_every=1")  # fmt: skip
    logging.getLogger("rlite").setLevel(logging.ERROR)  # the trials' own warnings are expected

    trials = {
        "sigkill": lambda r, w: signal_trial(signal.SIGKILL, r, w, config, model_dir, reference, duration),
        "sigterm": lambda r, w: signal_trial(signal.SIGTERM, r, w, config, model_dir, reference, duration),
        "nan": lambda r, w: nan_trial(r, w, config, model_dir, reference, duration),
        "engine_kill": lambda r, w: engine_trial(r, w, config, model_dir, reference_engine, duration),
        "corrupt_latest": lambda r, w: corrupt_trial(r, w, config, model_dir, reference, duration, prepared),
        "torn_log": lambda r, w: torn_log_trial(r, w, config, model_dir, reference, duration, prepared),
        "malicious_checkpoint": lambda r, w: malicious_trial(r, w, config, model_dir, reference, duration, prepared),
        "disk_full": lambda r, w: disk_full_trial(r, w, config, model_dir, reference, duration),
        "engine_start_death": lambda r, w: engine_start_trial(r, w, config, model_dir, reference_engine, duration),
        "engine_exhausted": lambda r, w: engine_exhausted_trial(r, w, config, model_dir, reference_engine, duration),
        "code_in_config": lambda r, w: code_in_config_trial(r, w, config, model_dir, reference, duration, exported),
        "linked_files": lambda r, w: linked_files_trial(r, w, config, model_dir, reference, duration, exported),
        "malformed_state": lambda r, w: malformed_state_trial(r, w, config, model_dir, reference, duration, prepared),
    }
    table = []
    for kind in args.kinds.split(","):
        counts = [0, 0, 0, 0]
        bitwise_applies = True
        began = time.perf_counter()
        for trial in range(args.trials):
            work = root / f"{kind}-{trial}"
            work.mkdir()
            injected, survived, bitwise, lost = trials[kind](rng, work)
            bitwise_applies = bitwise is not None
            for i, value in enumerate((injected, survived, bool(bitwise), lost)):
                counts[i] += int(value)
            shutil.rmtree(work, ignore_errors=True)
        table.append((kind, counts, bitwise_applies, (time.perf_counter() - began) / args.trials))
        print(f"{kind}: {counts} ({table[-1][3]:.1f} s per trial)", file=sys.stderr, flush=True)
    shutil.rmtree(root, ignore_errors=True)

    print(f"torch {torch.__version__}, {STEPS}-step tiny runs, {args.trials} trials per kind, seed {args.seed}, "
          f"undisturbed subprocess run {duration:.1f} s\n")  # fmt: skip
    print("| fault | trials | injected | survived | resumed bitwise | data lost | s / trial |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for kind, (injected, survived, bitwise, lost), applies, per in table:
        shown = f"{bitwise}/{args.trials}" if applies else "n/a"
        print(f"| {kind} | {args.trials} | {injected} | {survived} | {shown} | {lost} | {per:.1f} |")


if __name__ == "__main__":
    main()
