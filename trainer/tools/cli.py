"""The ``rlite`` command: ``train``, ``eval``, ``chat``, ``generate``, ``config``, ``plugins``, ``info`` and ``audit``.

Also runs as ``python -m rlite ...`` and ``torchrun --nproc_per_node N -m rlite train ...``.
Configuration and plugin problems print one line on stderr and exit with status 2; a run stopped
by failing reward functions prints their traceback and exits with status 3; one stopped on a fault
(non-finite updates, a dying engine, a full disk) exits with 4 and a preempted one with 75; nothing heavy
(transformers, datasets) is imported before ``train`` needs it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlite import __version__
from rlite.config import ConfigError, config_to_yaml
from rlite.plugin_manager import (  # noqa: F401 (load_run_config: the name tests and scripts use)
    REGISTRY_KINDS,
    PluginError,
    RlitePluginManager,
    build_manager,
    load_run_config,
)
from rlite.reward_runner import RewardFailureError
from rlite.run.faults import RunStopped

EXIT_USAGE = 2
EXIT_REWARDS_FAILED = 3
"""Exit status of a run stopped because its reward functions failed or timed out too often."""

OVERRIDES_HELP = "key.path=value overrides applied on top of the YAML file, e.g. training.steps=10"
CONFIG_OR_RUN_HELP = "a YAML config file, or a run folder (its config.yaml, with logging.run_dir set to that folder)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlite",
        description="Reinforcement-learning post-training of LLMs (GRPO, PPO and relatives).",
    )
    parser.add_argument("--version", action="version", version=f"rlite {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    train = commands.add_parser(
        "train",
        help="run a training job from a YAML config",
        description="Run a training job. Under torchrun every rank runs this command.",
    )
    add_config_arguments(train)
    train.set_defaults(func=cmd_train)

    evaluate = commands.add_parser(
        "eval",
        help="evaluate a run's latest checkpoint or a model on the held-out prompts, without training",
        description="Evaluate the model a run would start from (checkpoint.resume's checkpoint, else model.path) "
        "on the held-out prompts as the run's evaluations do; append the metrics to <run_dir>/eval.jsonl. "
        "RUN_DIR: a run folder (its config.yaml, its checkpoints). "
        "An exported model: `rlite eval CONFIG model.path=RUN/hf_model checkpoint.resume=never`.",
    )
    add_config_arguments(evaluate)
    evaluate.set_defaults(func=cmd_eval)

    config = commands.add_parser(
        "config",
        help="print the resolved config (YAML + overrides + defaults) as YAML",
        description="Load and validate a config exactly as `rlite train` would, and print it with every default filled in.",
    )
    add_config_arguments(config)
    config.add_argument(
        "--doc", action="store_true",
        help="write each field's docstring (and each plugin option's) as a comment above its value",
    )  # fmt: skip
    config.set_defaults(func=cmd_config)

    plugins = commands.add_parser(
        "plugins",
        help="list installed plugins, what they register and which hooks they implement",
        description="List built-in and third-party plugins (entry-point group `rlite`), the names "
        "each registers per kind, the lifecycle hooks each implements, and plugins that failed to load.",
    )
    plugins.add_argument("--json", action="store_true", help="print JSON instead of a table")
    plugins.set_defaults(func=cmd_plugins)

    info = commands.add_parser(
        "info",
        help="print where a run stands (steps, reward, held-out accuracy, time, the model) and what produced it",
        description="Print where the run in RUN_DIR stands (steps done of planned, the last step's reward, the "
        "last held-out accuracy, time in training steps, the exported model and the latest checkpoint), then the "
        "provenance it recorded: the first row of metrics.jsonl (and the rows a resumed run added) and the record "
        "in each checkpoint.",
    )
    info.add_argument("run_dir", metavar="RUN_DIR", help="the run's output folder (logging.run_dir)")
    info.add_argument("--json", action="store_true", help="print the records as JSON")
    info.set_defaults(func=cmd_info)

    chat = commands.add_parser(
        "chat",
        help="talk to a trained model: prompts from stdin, templated as in training, replies on stdout",
        description="Read user turns from stdin (one per line; piped input works), format each exactly as training "
        "formatted its prompts (the run's data.chat_template and data.system_prompt; for a model folder, its "
        "tokenizer's chat template), generate and print the reply. MODEL_OR_RUN: a run folder (its hf_model/, "
        "else its latest checkpoint) or a Hugging Face model folder.",
    )
    chat.add_argument("model", metavar="MODEL_OR_RUN", help="a run folder or a Hugging Face model folder")
    add_generation_arguments(chat)
    chat.add_argument("--multi-turn", action="store_true",
                      help="keep the conversation: each turn sees the previous turns and replies (default: every "
                      "line is its own single-turn prompt, as training's prompts are)")  # fmt: skip
    chat.add_argument("--show-prompt", action="store_true", help="print the exact text the model is given on stderr")
    chat.set_defaults(func=cmd_chat)

    generate = commands.add_parser(
        "generate",
        help="generate replies for a file of prompts, templated as in training (JSONL out)",
        description="Like `rlite chat`, for a file of prompts: FILE.jsonl (one object per line, the prompt in "
        "--prompt-key; other columns are copied to the output) or FILE.txt (one prompt per line). Each output "
        "row adds prompt_text (what the model was given), completion and finish_reason.",
    )
    generate.add_argument("model", metavar="MODEL_OR_RUN", help="a run folder or a Hugging Face model folder")
    generate.add_argument("--prompts", required=True, metavar="FILE", help="prompts: .jsonl or .txt")
    generate.add_argument("--out", required=True, metavar="FILE", help="where to write the rows (.jsonl)")
    generate.add_argument("--prompt-key", default="prompt", help="the prompt's column in a .jsonl file (default: prompt)")
    generate.add_argument("--batch-size", type=int, default=64, help="prompts per generate call (default: 64)")
    add_generation_arguments(generate)
    generate.set_defaults(func=cmd_generate)

    audit = commands.add_parser(
        "audit",
        help="check a config's invariants on a tiny replica of the run (pass/fail table; exit 1 on a failure)",
        description="Build a tiny replica of the configured run (same plugins, algorithm, backend, engine and "
        "quantizer; a tiny model of the same architecture family) and check: first on-policy ratio exactly 1, "
        "world size 2 == 1, micro-batch x accumulation equivalence, weight-sync checksum and version every "
        "step, the engine's mismatch metrics, the estimator and loss against their documented formulas, and "
        "resume == uninterrupted for 3 steps.",
    )
    add_config_arguments(audit)
    audit.add_argument("--workdir", help="folder for the replica's files (default: a new temporary folder)")
    audit.set_defaults(func=cmd_audit)
    return parser


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """The positional ``CONFIG_OR_RUN`` and ``KEY=VALUE`` overrides of the commands that load a config."""
    parser.add_argument("config", metavar="CONFIG_OR_RUN", help=CONFIG_OR_RUN_HELP)
    parser.add_argument("overrides", metavar="KEY=VALUE", nargs="*", help=OVERRIDES_HELP)


def add_generation_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="tokens per reply at most (default: a run's rollout.max_new_tokens, else 256)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (the default) is greedy decoding")
    parser.add_argument("--seed", type=int, default=0, help="seed of sampled (temperature > 0) decoding")
    parser.add_argument("--raw", action="store_true",
                        help="give prompts to the model as they are, without the chat template")  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rlite`` console script; returns the process exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version and usage errors
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else EXIT_USAGE)
    args.process_entry = argv is None  # the ``rlite`` command itself, not a call from Python
    if args.command != "train":  # only train has a preemption of its own: a SIGTERM ends the others as ever
        from rlite import entry

        entry.release()
    if args.process_entry and int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        _run_as_rank(args)  # never returns
    if not args.process_entry:
        return dispatch(args)
    try:
        code = dispatch(args)
        sys.stdout.flush()  # inside the try: a pipe closed early (``| head``) fails here, not at exit
        return code
    except BrokenPipeError:
        return reader_went_away()


def reader_went_away() -> int:
    """``rlite info RUN | head``: the reader closed the pipe. Like ``cat``, stop quietly; stdout points
    at /dev/null so that the interpreter's last flush does not print a traceback."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 141  # 128 + SIGPIPE, what a shell reports for a command a pipe stopped


def _run_as_rank(args: argparse.Namespace) -> None:
    """A rank of a multi-rank launch (torchrun): run the command, then leave through ``os._exit`` with
    its status (:func:`rlite.distributed.leave_rank_process`), so the interpreter's teardown cannot
    turn a finished run into an abort; an unexpected error still prints its traceback, exit 1."""
    import traceback

    from rlite.distributed import leave_rank_process

    try:
        code = dispatch(args)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001  (printed as the interpreter would, then the status)
        traceback.print_exc()
        code = 1
    leave_rank_process(code)


def dispatch(args: argparse.Namespace) -> int:
    """Run the parsed command; the problems a user fixes become one line and an exit status."""
    try:
        return args.func(args)
    except (ConfigError, PluginError) as exc:  # problems the user fixes: one line, no traceback
        print(f"rlite {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except RunStopped as exc:  # a fault the run could not get past, or a preemption: a message, no traceback
        print(f"rlite {args.command}: stopped: {exc}", file=sys.stderr)
        return exc.exit_code
    except RewardFailureError as exc:  # the message carries the reward function's own traceback
        print(f"rlite {args.command}: stopped: {exc}", file=sys.stderr)
        return EXIT_REWARDS_FAILED
    except KeyboardInterrupt:
        print("rlite: interrupted", file=sys.stderr)
        return 130


# --------------------------------------------------------------------------------------------------
# train / config
# --------------------------------------------------------------------------------------------------


def config_source(given: str, overrides: Sequence[str]) -> tuple[str, list[str]]:
    """``(config file, overrides)`` of a CONFIG_OR_RUN argument: a run folder stands for its own
    ``config.yaml`` with ``logging.run_dir`` set to the folder (the user's overrides still come last)."""
    folder = Path(given)
    if not folder.is_dir():
        return given, list(overrides)
    if not (folder / "config.yaml").is_file():
        raise ConfigError(f"{given!r} is a folder without config.yaml, so not a run folder; give a run folder "
                          "(logging.run_dir of a run) or a YAML config file")
    return str(folder / "config.yaml"), [f"logging.run_dir={folder}", *overrides]


def cmd_train(args: argparse.Namespace) -> int:
    from rlite import entry
    from rlite.config.schema import CheckpointConfig
    from rlite.run.faults import EXIT_PREEMPTED, Preemption

    # first thing: a SIGTERM (a scheduler's preemption) while the config loads, torch imports or the
    # model is built stops the run cleanly (exit 75) instead of killing it; the handlers stay installed
    # until the command returns, so one during the final export does not kill the process either
    preemption = Preemption(CheckpointConfig.preempt_timeout_s)
    preemption.install()
    finished = False
    try:
        if args.process_entry and entry.received():  # while the command itself was importing (rlite.entry)
            raise RunStopped("SIGTERM received while rlite was starting: nothing ran and nothing new is saved; run the "
                             "same command again (it resumes from the latest checkpoint, if any)",
                             exit_code=EXIT_PREEMPTED)  # fmt: skip
        cfg, pm = load_run_config(*config_source(args.config, args.overrides))
        for broken in pm.failed:  # the run goes on without it, but never silently
            print(f"rlite train: warning: plugin {broken.name!r} ({broken.distribution}) is skipped: {broken.error}",
                  file=sys.stderr)
        from rlite.run.loop import run_training  # heavy (torch, transformers): only when training

        run_training(cfg, pm, preemption)
        finished = True
        return 0
    finally:
        preemption.uninstall()
        if finished and args.process_entry:  # all saved and exported: a SIGTERM while the process exits has nothing to stop
            import signal

            signal.signal(signal.SIGTERM, signal.SIG_IGN)


def cmd_eval(args: argparse.Namespace) -> int:
    cfg, pm = load_run_config(*config_source(args.config, args.overrides))
    from rlite.run.evaluation import run_evaluation  # heavy (torch, transformers)

    run_evaluation(cfg, pm)
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from rlite.config import optional_dependencies_deferred

    with optional_dependencies_deferred():  # a printer needs no optional package; `rlite train` checks them
        cfg, pm = load_run_config(*config_source(args.config, args.overrides))
    if args.doc:
        from rlite.config.docs import documented_yaml

        sys.stdout.write(documented_yaml(cfg, pm))
    else:
        sys.stdout.write(config_to_yaml(cfg))
    return 0


# --------------------------------------------------------------------------------------------------
# chat, generate
# --------------------------------------------------------------------------------------------------


def check_generation_arguments(args: argparse.Namespace) -> None:
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise ConfigError(f"--temperature must be >= 0 and finite (0 is greedy), got {args.temperature}")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")


def cmd_chat(args: argparse.Namespace) -> int:
    check_generation_arguments(args)
    if args.multi_turn and args.raw:
        raise ConfigError("--multi-turn needs the chat template to lay out the turns; drop --raw")
    from rlite.tools.generation import open_chat_model

    interactive = sys.stdin.isatty()
    with open_chat_model(args.model, raw=args.raw, max_new_tokens=args.max_new_tokens) as chat:
        if interactive:
            layout = "the chat template" if chat.prompt_format.chat_template else "no template (raw)"
            print(f"rlite chat: {chat.source}; prompts formatted with {layout}, as in training. Ctrl-D ends.",
                  file=sys.stderr)
        history: list[dict[str, str]] = []
        for turn, line in enumerate(iter(StdinTurns(interactive), None)):
            if not line.strip():
                continue
            user = {"role": "user", "content": line}
            (reply,) = chat.reply([[*history, user] if args.multi_turn else line], max_new_tokens=args.max_new_tokens,
                                  temperature=args.temperature, seed=args.seed + turn)
            if args.show_prompt:
                print(reply.prompt_text, file=sys.stderr, flush=True)
            print(reply.completion, flush=True)
            if args.multi_turn:
                history += [user, {"role": "assistant", "content": reply.completion}]
    return 0


class StdinTurns:
    """The lines of stdin without their newline, one per call (None at the end), read as bytes and decoded as
    UTF-8: a line that is not UTF-8 text, or holds a NUL, is refused naming its number rather than handed to
    the tokenizer (it raised a TypeError on undecodable bytes)."""

    def __init__(self, interactive: bool) -> None:
        self.interactive = interactive
        self.number = 0

    def __call__(self) -> str | None:
        from rlite.tools.generation import check_prompt_text

        if self.interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        stream = getattr(sys.stdin, "buffer", None)  # a test's StringIO has none
        raw = stream.readline() if stream is not None else sys.stdin.readline()
        if not raw:
            return None
        self.number += 1
        where = f"stdin line {self.number}"
        if isinstance(raw, bytes):
            try:
                raw = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ConfigError(f"{where} is not UTF-8 text (byte {exc.start + 1} of the line: "
                                  f"{exc.object[exc.start:exc.start + 1]!r}); rlite chat reads UTF-8") from None
        line = raw.rstrip("\n").rstrip("\r")
        check_prompt_text(line, where)
        return line


def cmd_generate(args: argparse.Namespace) -> int:
    check_generation_arguments(args)
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {args.batch_size}")
    from rlite.tools.generation import open_chat_model, read_prompt_file

    out = check_output_file(args.out, args.prompts)
    rows = read_prompt_file(args.prompts, args.prompt_key)
    # written beside --out and renamed at the end: a failure leaves no half file, and a folder that cannot be
    # written is found before the model loads
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        handle = open(tmp, "x")
    except OSError as exc:
        raise ConfigError(f"--out: cannot write in {str(out.parent)!r} ({exc.strerror or exc})") from None
    try:
        with handle, open_chat_model(args.model, raw=args.raw, max_new_tokens=args.max_new_tokens,
                                     prompts=[row["prompt"] for row in rows], batch_size=args.batch_size) as chat:
            for start in range(0, len(rows), args.batch_size):
                batch = rows[start : start + args.batch_size]
                replies = chat.reply([row["prompt"] for row in batch], max_new_tokens=args.max_new_tokens,
                                     temperature=args.temperature, seed=args.seed + start)  # fmt: skip
                for row, reply in zip(batch, replies):
                    written = {**row, "prompt_text": reply.prompt_text, "completion": reply.completion,
                               "finish_reason": reply.finish_reason}  # fmt: skip
                    handle.write(json.dumps(written) + "\n")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    print(f"rlite generate: {len(rows)} replies from {chat.source} written to {out}", file=sys.stderr)
    return 0


def check_output_file(out: str, prompts: str) -> Path:
    """``--out``, refused before anything runs when it cannot be the output file: a folder, a file in a folder
    that does not exist, or the ``--prompts`` file itself (which the output would overwrite)."""
    path = Path(out)
    if path.is_dir():
        raise ConfigError(f"--out: {out!r} is a folder; give the path of the .jsonl file to write")
    if not path.parent.is_dir():
        raise ConfigError(f"--out: the folder {str(path.parent)!r} does not exist; create it first")
    if path.exists() and Path(prompts).exists() and os.path.samefile(path, prompts):
        raise ConfigError(f"--out: {out!r} is the --prompts file; writing the replies would overwrite the prompts")
    return path


# --------------------------------------------------------------------------------------------------
# audit, info
# --------------------------------------------------------------------------------------------------


def cmd_audit(args: argparse.Namespace) -> int:
    args.config, args.overrides = config_source(args.config, args.overrides)
    try:
        _, pm = load_run_config(args.config, args.overrides)  # validates the config as train would
    except ConfigError as exc:
        if not str(exc).startswith("model.path: missing value"):
            raise
        raise ConfigError(missing_model_message(args.config, args.overrides)) from None
    from rlite.hf_models import quiet_transformers_progress
    from rlite.tools.audit import FAIL, print_table, run_audit

    with quiet_transformers_progress():  # its replicas' load/save bars would come between rlite's lines
        checks, note = run_audit(args.config, list(args.overrides), pm, args.workdir)
    print_table(checks, f"rlite audit {args.config}: replica {note}")
    failed = [c.name for c in checks if c.result == FAIL]
    if failed:
        print(f"rlite audit: FAILED: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0



def missing_model_message(config: str, overrides: Sequence[str]) -> str:
    """The audit's error for a config that leaves ``model.path`` to be given: the replica is a tiny model
    of the configured model's architecture family, so the audit needs the model too. Gives the command
    with the path, and the config's own comment lines that say how to get the model."""
    given = " ".join([config, *overrides])
    text = (f"model.path: missing value. The audit builds a tiny replica of the model's architecture family, so it "
            f"needs the model as the run does: rlite audit {given} model.path=PATH")
    try:
        comments = [line.lstrip("#").strip() for line in Path(config).read_text().splitlines() if line.startswith("#")]
    except OSError:
        comments = []
    hints = [line.replace("rlite train", "rlite audit", 1) for line in comments
             if "pip install" in line or "model.path=" in line]
    return text + (". The config's comments say how to get it: " + "; then ".join(hints) if hints else "")


def cmd_info(args: argparse.Namespace) -> int:
    from rlite.run.checkpoint import checkpoint_root, list_checkpoints, unsafe_content
    from rlite.run.provenance import describe, metrics_records, read_checkpoint_record
    from rlite.run.status import describe_status, run_status

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"RUN_DIR {str(run_dir)!r} is not a folder")
    rows = metrics_records(run_dir / "metrics.jsonl")
    checkpoints = [(path.name, read_checkpoint_record(path)) for path in list_checkpoints(checkpoint_root(run_dir))]
    if not rows and not any(record for _, record in checkpoints):
        raise ConfigError(f"{run_dir}: no provenance recorded (no metrics.jsonl provenance row, no checkpoint record)")
    # a checkpoint's record is JSON, but its pickles are what a resume opens: say which ones it would refuse
    refused = [problem for problem in map(unsafe_content, list_checkpoints(checkpoint_root(run_dir))) if problem]
    damaged = checkpoint_damage_report(run_dir)
    if args.json:
        print(json.dumps({"status": run_status(run_dir), "metrics": rows, "checkpoints": dict(checkpoints),
                          "damaged": damaged}, indent=2, sort_keys=True))  # fmt: skip
    else:
        print("\n".join(describe_status(run_status(run_dir))))
        for row in rows:
            print(f"metrics.jsonl, run started at step {row['step']}:")
            print("\n".join(describe(row["provenance"], "  ")))
        for name, record in checkpoints:
            print(f"checkpoints/{name}:")
            print("\n".join(describe(record, "  ") if record else ["  (no record: written before rlite recorded provenance)"]))
            if name in damaged:
                print(f"  DAMAGED: {damaged[name]} (rlite train resumes from an older one; rlite chat and eval refuse it)")
    if refused:
        raise ConfigError("; ".join(refused))
    return 0


def checkpoint_damage_report(run_dir: Path) -> dict[str, str]:
    """Checkpoint name -> what is damaged in it, for ``rlite info``: what shows without hashing the shards
    (:func:`rlite.run.checkpoint.checkpoint_damage`: the manifest's sizes, the DCP metadata, the trainer states
    loaded and checked)."""
    from rlite.run.checkpoint import checkpoint_damage, checkpoint_root, list_checkpoints

    report = {path.name: checkpoint_damage(path) for path in list_checkpoints(checkpoint_root(run_dir))}
    return {name: damage for name, damage in report.items() if damage}


# --------------------------------------------------------------------------------------------------
# plugins
# --------------------------------------------------------------------------------------------------


def describe_plugins(pm: RlitePluginManager) -> dict[str, Any]:
    """What ``rlite plugins`` reports, as plain data (also the ``--json`` output).

    ``plugins`` lists every plugin with ``registers`` (kind -> names) and ``lifecycle_hooks``;
    plugins that failed to import carry an ``error``. ``errors`` holds problems of the registries
    as a whole, such as one name registered by two plugins.
    """
    registered: dict[str, dict[str, list[str]]] = {}
    errors: list[str] = []
    try:
        for kind, registry in pm.registries.items():
            for entry in registry.entries.values():
                registered.setdefault(entry.plugin, {}).setdefault(kind, []).append(entry.name)
    except Exception as exc:  # a broken registration hook must not hide the rest of the report
        errors.append(f"{type(exc).__name__}: {exc}" if not isinstance(exc, PluginError) else str(exc))
    registration_hooks = {kind.hook for kind in REGISTRY_KINDS.values()}
    plugins = []
    for info in pm.plugin_infos():
        plugins.append(
            {
                "name": info.name,
                "distribution": info.distribution,
                "version": info.version,
                "registers": {kind: sorted(names) for kind, names in registered.get(info.name, {}).items()},
                "lifecycle_hooks": [hook for hook in info.hooks if hook not in registration_hooks],
                "error": info.error,
            }
        )
    return {"plugins": plugins, "errors": errors}


def cmd_plugins(args: argparse.Namespace) -> int:
    report = describe_plugins(build_manager())
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_plugin_tables(report)
    for error in report["errors"]:
        print(f"rlite plugins: error: {error}", file=sys.stderr)
    return 1 if report["errors"] else 0


def print_plugin_tables(report: dict[str, Any], console=None) -> None:
    """The tables of ``rlite plugins`` on ``console`` (a rich Console; default: stdout)."""
    from rich.console import Console
    from rich.table import Table

    if console is None:  # piped output is not cut at rich's default of 80 columns (COLUMNS still wins)
        console = Console(width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 160)
    loaded = [p for p in report["plugins"] if p["error"] is None]
    failed = [p for p in report["plugins"] if p["error"] is not None]

    table = Table(title="rlite plugins", title_justify="left", show_lines=True)
    table.add_column("plugin", style="bold", overflow="fold")
    table.add_column("distribution", overflow="fold")
    table.add_column("registers", overflow="fold")
    table.add_column("lifecycle hooks", overflow="fold")
    for plugin in loaded:
        registers = "\n".join(f"{kind}: {', '.join(names)}" for kind, names in plugin["registers"].items())
        table.add_row(
            plugin["name"],
            f"{plugin['distribution']} {plugin['version']}".strip(),
            registers or "-",
            "\n".join(plugin["lifecycle_hooks"]) or "-",
        )
    console.print(table)

    if failed:
        broken = Table(title="plugins that failed to load", title_justify="left", show_lines=True)
        broken.add_column("plugin", style="bold red", overflow="fold")
        broken.add_column("distribution", overflow="fold")
        broken.add_column("error", overflow="fold")
        for plugin in failed:
            broken.add_row(
                plugin["name"], f"{plugin['distribution']} {plugin['version']}".strip(), plugin["error"]
            )
        console.print(broken)
