"""``rlite chat`` and ``rlite generate``: talk to a trained model the way training talked to it.

A run's prompts reach the model wrapped in the tokenizer's chat template (``data.chat_template``,
on by default) with ``data.system_prompt`` first, so the bare prompt ``"22+95="`` is text the model
never saw in training. These commands format every prompt with the function training uses
(:func:`rlite.data.format_prompt`), tokenise it as training does, and decode with rlite's own
transformers engine (greedy by default; ``temperature`` is applied exactly as in the rollouts). That
engine is used directly, whatever ``rollout.engine`` the run had: a local single-process decode, which
is why this module lives beside the loop rather than in :mod:`rlite.run` (whose modules reach engines
only through their contract).

``MODEL_OR_RUN`` is either

* a run folder (it holds ``config.yaml``): its config says whether and how prompts were templated,
  and the model is its exported ``hf_model/``, or its latest intact checkpoint when there is no export
  or the checkpoint is newer (turned into a Hugging Face model in a temporary folder, as the export at
  the end of a run would), or
* a Hugging Face model folder: prompts are templated when its tokenizer has a chat template.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlite.config import ConfigError, RunConfig
from rlite.data import format_prompt


@dataclass
class PromptFormat:
    """How a prompt becomes the text the model sees, as in training (``data.chat_template``,
    ``data.system_prompt``)."""

    chat_template: bool
    system_prompt: str | None = None


@dataclass
class Reply:
    prompt_text: str
    """The prompt after the chat template: the exact text the model was given."""
    completion: str
    finish_reason: str
    """``stop`` (the model ended its answer) or ``length`` (``max_new_tokens`` ran out)."""


class ChatModel:
    """A model, its tokenizer and its run's prompt format, with rlite's transformers engine to decode."""

    def __init__(self, model, tokenizer, prompt_format: PromptFormat, source: str, max_new_tokens: int = 256) -> None:
        from rlite.engines.transformers.engine import TransformersEngine

        if prompt_format.chat_template and not getattr(tokenizer, "chat_template", None):
            raise ConfigError(f"{source}: the tokenizer has no chat template; pass --raw to give prompts as they are")
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.tokenizer = tokenizer
        self.prompt_format = prompt_format
        self.source = source
        """What was loaded (a folder, or a run's checkpoint), for messages."""
        self.max_new_tokens = max_new_tokens
        """The default length limit of a reply (a run's ``rollout.max_new_tokens``)."""
        eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]  # training's stop tokens
        self.engine = TransformersEngine(model, pad_token_id=tokenizer.pad_token_id, eos_token_ids=eos)

    def prompt_text(self, prompt: str | list[dict[str, str]]) -> str:
        """The text the model sees for ``prompt`` (a string or chat messages), exactly as training formats it."""
        fmt = self.prompt_format
        return format_prompt(prompt, self.tokenizer, fmt.chat_template, fmt.system_prompt)

    def reply(self, prompts: Sequence[str | list[dict[str, str]]], *, max_new_tokens: int = 64,
              temperature: float = 0.0, seed: int = 0) -> list[Reply]:  # fmt: skip
        """One completion per prompt; ``temperature`` 0 is greedy."""
        from rlite.engines.base import SamplingParams

        if not prompts:
            return []
        texts = [self.prompt_text(prompt) for prompt in prompts]
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]  # as build_prompt_set tokenises
        params = SamplingParams(
            max_new_tokens=max_new_tokens, greedy=temperature == 0.0, temperature=temperature or 1.0, seed=seed
        )
        completions = self.engine.generate([list(row) for row in ids], params)
        answers = self.tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
        return [Reply(text, answer, c.finish_reason) for text, answer, c in zip(texts, answers, completions)]


# --------------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------------


def is_run_folder(path: Path) -> bool:
    return os.path.lexists(path / "config.yaml") and not (path / "config.json").is_file()


@contextlib.contextmanager
def open_chat_model(target: str | Path, *, raw: bool = False, dtype: str = "float32") -> Iterator[ChatModel]:
    """The model ``target`` names (a run folder or a Hugging Face folder), ready to reply. ``raw``:
    prompts go to the model as they are, never templated. A run folder is read as data
    (:func:`read_run_folder_config`): nothing its config names runs."""
    from rlite.hf_models import quiet_transformers_progress

    path = Path(target)
    if not path.is_dir():
        raise ConfigError(f"MODEL_OR_RUN {str(target)!r} is not a folder (a run folder or a Hugging Face model folder)")
    with quiet_transformers_progress(), contextlib.ExitStack() as cleanup:
        if is_run_folder(path):
            scratch = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="rlite-chat-")))
            cfg = read_run_folder_config(path, scratch)
            model_dir, source = run_model_folder(path, cfg, scratch)
            prompt_format = PromptFormat(cfg.data.chat_template and not raw, cfg.data.system_prompt)
            dtype, max_new_tokens = cfg.model.dtype, cfg.rollout.max_new_tokens
        elif (path / "config.json").is_file():
            model_dir, source = path, str(path)
            prompt_format, max_new_tokens = None, 256
        else:
            raise ConfigError(
                f"MODEL_OR_RUN {str(target)!r} is neither a run folder (no config.yaml) nor a Hugging Face model "
                "folder (no config.json)"
            )
        model, tokenizer = load_model_and_tokenizer(model_dir, dtype)
        if prompt_format is None:  # a plain model folder: templated when its tokenizer has a template
            prompt_format = PromptFormat(bool(getattr(tokenizer, "chat_template", None)) and not raw)
        yield ChatModel(model, tokenizer, prompt_format, source, max_new_tokens)


RUN_FOLDER_KEYS: dict[str, tuple[str, ...] | None] = {
    "model": None,
    "parallelism": None,
    "training": None,
    "data": ("chat_template", "system_prompt", "max_prompt_tokens"),
    "rollout": ("max_new_tokens",),
}
"""What ``rlite chat`` and ``rlite generate`` read of a run folder's ``config.yaml`` (None: the whole section):
how prompts were given to the model, and the model a checkpoint holds (its sections decide how a checkpoint
turns back into a Hugging Face model). Nothing else: not the rewards, workflows, plugins or loggers it names."""


def read_run_folder_config(run_dir: Path, scratch: Path) -> RunConfig:
    """The run's ``config.yaml`` read as data: the keys of :data:`RUN_FOLDER_KEYS` (every other key at its
    default), as plain values (no interpolation resolved, no plugin or reward looked up, so nothing the file
    names is imported), ``model.trust_remote_code`` off whatever it says, and every folder a checkpoint's
    backend could write to (the run folder, the optimizer offload folder) pointed at ``scratch``. The file is
    opened without following a link (:mod:`rlite.run.files`)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from rlite.config.loader import config_from_data
    from rlite.run.files import read_run_file

    path = run_dir / "config.yaml"
    try:  # omegaconf's YAML reading (as rlite train's: 1e-3 is a number), its interpolations left unresolved
        raw = OmegaConf.to_container(OmegaConf.create(read_run_file(path).decode("utf-8")), resolve=False)
    except (UnicodeDecodeError, ValueError, OmegaConfBaseException) as exc:
        raise ConfigError(f"{path}: not the YAML config rlite writes ({' '.join(str(exc).split())[:200]})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, as rlite writes it")
    kept: dict[str, Any] = {}
    for section, keys in RUN_FOLDER_KEYS.items():
        values = raw.get(section) or {}
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: {section} must be a mapping, as rlite writes it")
        kept[section] = {key: value for key, value in values.items() if keys is None or key in keys}
    kept["model"]["trust_remote_code"] = False  # a folder's model code never runs here (docs/faults.md)
    kept["data"]["task"] = "addition"  # no prompt is read from the run's data; the schema wants a source
    kept["training"]["optimizer_offload_dir"] = str(scratch / "optimizer_offload")
    kept["logging"] = {"run_dir": str(scratch)}
    return config_from_data(kept, str(path))


def run_model_folder(run_dir: Path, cfg: RunConfig, scratch: Path) -> tuple[Path, str]:
    """The run's exported ``hf_model/``, unless its latest checkpoint is newer (a run resumed for more steps
    and stopped before its end writes checkpoints but no new export): that checkpoint, exported into
    ``scratch``, as the export at the end of the run would have. With the description of what was loaded.

    A damaged latest checkpoint is refused (exit status 2, naming it and why) rather than answered for by an
    older one, and neither the export nor a checkpoint may hold a link (:mod:`rlite.run.files`)."""
    from rlite.run.checkpoint import MARKER, find_resume_checkpoint
    from rlite.run.files import link_in_folder, refusal

    exported = run_dir / "hf_model"
    found = link_in_folder(exported)
    if found:
        raise refusal(*found)
    checkpoint = find_resume_checkpoint(run_dir, "auto", fallback=False)
    if (exported / "config.json").is_file() and (
        checkpoint is None or (exported / "config.json").stat().st_mtime >= (checkpoint / MARKER).stat().st_mtime
    ):
        return exported, str(exported)
    if checkpoint is None:
        raise ConfigError(
            f"{run_dir}: the run has no exported hf_model/ and no checkpoint yet (checkpoint.every, "
            "checkpoint.export_hf); nothing to load"
        )
    folder = scratch / "hf_model"
    export_checkpoint(cfg, checkpoint, folder)
    return folder, str(checkpoint)


def export_checkpoint(cfg: RunConfig, checkpoint: Path, out_dir: Path) -> None:
    """Load ``checkpoint`` into the run's training backend (one process) and export its policy as a
    Hugging Face folder, as the end of the run would have. The backend is looked up among the installed
    plugins (the folder's ``plugins`` section is not read: a folder names a backend, it never brings one)."""
    from rlite.distributed import init_distributed, shutdown_distributed
    from rlite.plugin_manager import build_manager, resolve_choice
    from rlite.run.build import load_tokenizer
    from rlite.run.checkpoint import load_checkpoint
    from rlite.run.export import export_hf
    from rlite.run.lifecycle import model_state

    pm = build_manager()
    ctx = init_distributed()
    finished = False
    try:
        make_backend, backend_cfg = resolve_choice(pm.registry("training_backend"), cfg.parallelism.backend)
        backend = make_backend(cfg, backend_cfg, ctx.device, 1)
        try:
            state = model_state(backend, None)
            load_checkpoint(checkpoint, state, rank=ctx.rank)
            backend.load_checkpoint_state(state)
            export_hf(backend, load_tokenizer(cfg), out_dir, is_main=True, source_model=cfg.model.path)
        finally:
            backend.close()
        finished = True
    finally:
        shutdown_distributed(ctx, finished=finished)


def load_model_and_tokenizer(model_dir: Path, dtype: str):
    """The model (on the GPU when there is one) and its tokenizer, both from ``model_dir`` (an export
    holds the tokenizer training used)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlite.hf_models import DTYPES

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=DTYPES[dtype])
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{model_dir}: cannot load a causal LM and its tokenizer ({exc})") from None
    return model.to("cuda" if torch.cuda.is_available() else "cpu"), tokenizer


# --------------------------------------------------------------------------------------------------
# prompt files
# --------------------------------------------------------------------------------------------------


def read_prompt_file(path: str | Path, prompt_key: str = "prompt") -> list[dict[str, Any]]:
    """Rows with the prompt under ``"prompt"``: a ``.jsonl`` file's objects (the prompt in column
    ``prompt_key``, a string or chat messages; the other columns are kept), or a ``.txt`` file's
    non-empty lines."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--prompts: {str(path)!r} not found")
    lines = path.read_text().splitlines()
    if path.suffix == ".txt":
        return [{"prompt": line} for line in lines if line.strip()]
    if path.suffix != ".jsonl":
        raise ConfigError(f"--prompts: {path} must be a .jsonl file (one JSON object per line) or a .txt file")
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise ConfigError(f"--prompts: {path} line {number} is not valid JSON ({exc})") from None
        if not isinstance(row, dict) or prompt_key not in row:
            raise ConfigError(f"--prompts: {path} line {number} has no {prompt_key!r} column (--prompt-key)")
        rows.append({**row, "prompt": row[prompt_key]})
    if not rows:
        raise ConfigError(f"--prompts: {path} holds no prompts")
    return rows
