"""``rlite chat`` and ``rlite generate``: talk to a trained model the way training talked to it.

A run's prompts reach the model wrapped in the tokenizer's chat template (``data.chat_template``,
on by default) with ``data.system_prompt`` first, so the bare prompt ``"22+95="`` is text the model
never saw in training. These commands format every prompt with the function training uses
(:func:`rlite.data.format_prompt`), tokenise it as training does, and decode with rlite's own
transformers engine (greedy by default; ``temperature`` is applied exactly as in the rollouts), whatever
``rollout.engine`` the run had: a local single-process decode. The engine comes from the registry like
every engine of a run, as the default engine's (``rollout.engine``'s default) registration builds it around
a model already loaded (its ``from_model``, docs/plugins.md's capabilities table), and is used through its
contract (``generate``).

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
from typing import TYPE_CHECKING, Any

from rlite.config import ConfigError, RunConfig
from rlite.data import format_prompt

if TYPE_CHECKING:
    from rlite.engines.base import RolloutEngine
    from rlite.run.limits import ModelShape


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


@dataclass
class GenerationBounds:
    """What a decode of a model may hold, checked before anything is allocated: its context
    (``max_position_embeddings``) and the memory of the transformers engine's decode, as ``rlite train``
    checks its own (:mod:`rlite.run.limits`). Estimated bytes: the weights (unless loaded already), the KV
    cache ``L * 2 * H_kv * d_head * (prompt + new) * b`` per sequence, the engine's token and log-prob buffers
    (12 bytes per new token), its attention mask (8 bytes per position) and a step's logits (fp32, 3 copies)."""

    shape: ModelShape | None
    """The model's shape (None: transformers cannot read its config; the loader then names the problem)."""
    dtype_bytes: int
    source: str
    """The model folder, for messages."""

    def new_tokens(self, requested: int | None, default: int, longest_prompt: int) -> int:
        """``requested`` (``--max-new-tokens``, checked as given), else ``default`` cut to the context that
        ``longest_prompt`` leaves (a model folder's default of 256 exceeds a small model's context)."""
        if requested is not None:
            return requested
        if self.shape is None or self.shape.max_positions is None:
            return default
        return max(1, min(default, self.shape.max_positions - longest_prompt))

    def check(self, longest_prompt: int, batch: int, max_new_tokens: int, *, weights_loaded: bool) -> None:
        """Refuse (:class:`~rlite.config.ConfigError`) a decode of ``batch`` prompts of up to ``longest_prompt``
        tokens and ``max_new_tokens`` new ones that outgrows the context or the memory available now."""
        from rlite.run.limits import GIB, available_memory

        shape = self.shape
        if shape is None:
            return
        total = longest_prompt + max_new_tokens
        if shape.max_positions is not None and total > shape.max_positions:
            fix = (f"lower --max-new-tokens to at most {shape.max_positions - longest_prompt}"
                   if longest_prompt < shape.max_positions else "shorten the prompt")  # fmt: skip
            raise ConfigError(
                f"--max-new-tokens {max_new_tokens} + a prompt of {longest_prompt} tokens = {total} tokens exceed the "
                f"model's context of {shape.max_positions} positions (max_position_embeddings of {self.source}): {fix}"
            )
        import torch

        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        per_sequence = (shape.layers * 2 * shape.kv_heads * shape.head_dim * total * self.dtype_bytes
                        + 12 * max_new_tokens + 8 * total + 3 * 4 * shape.vocab)  # fmt: skip
        needed = batch * per_sequence + (0 if weights_loaded else shape.parameters * self.dtype_bytes)
        available = available_memory(device)
        if available is not None and needed > available[0]:
            raise ConfigError(
                f"memory: decoding {batch} prompt(s) of up to {longest_prompt} tokens with --max-new-tokens "
                f"{max_new_tokens} needs about {needed / GIB:.2f} GiB ({'' if weights_loaded else 'the weights and '}"
                f"the KV cache of {total} positions per prompt) but {available[0] / GIB:.2f} GiB are available "
                f"({available[1]}): lower --max-new-tokens" + (" or --batch-size" if batch > 1 else "")
            )


def generation_bounds(model_dir: Path, dtype: str) -> GenerationBounds:
    """The bounds of ``model_dir``'s decode in ``dtype`` (its config read; no weight loaded, no code run)."""
    from transformers import AutoConfig

    from rlite.run.limits import DTYPE_BYTES, model_shape

    try:
        shape = model_shape(AutoConfig.from_pretrained(str(model_dir), trust_remote_code=False))
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        shape = None
    return GenerationBounds(shape, DTYPE_BYTES[dtype], str(model_dir))


class ChatModel:
    """A model, its tokenizer and its run's prompt format, with rlite's transformers engine to decode."""

    def __init__(self, model, tokenizer, prompt_format: PromptFormat, source: str, max_new_tokens: int = 256,
                 bounds: GenerationBounds | None = None) -> None:  # fmt: skip
        check_tokenizer(tokenizer, prompt_format, source)
        self.tokenizer = tokenizer
        self.prompt_format = prompt_format
        self.source = source
        """What was loaded (a folder, or a run's checkpoint), for messages."""
        self.max_new_tokens = max_new_tokens
        """The default length limit of a reply (a run's ``rollout.max_new_tokens``, else 256; cut to the context
        a prompt leaves)."""
        self.bounds = bounds
        """Checked before every decode (None: unchecked)."""
        eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]  # training's stop tokens
        self.engine = local_engine(model, pad_token_id=tokenizer.pad_token_id, eos_token_ids=eos)

    def prompt_text(self, prompt: str | list[dict[str, str]]) -> str:
        """The text the model sees for ``prompt`` (a string or chat messages), exactly as training formats it."""
        return formatted_prompt(prompt, self.tokenizer, self.prompt_format)

    def reply(self, prompts: Sequence[str | list[dict[str, str]]], *, max_new_tokens: int | None = None,
              temperature: float = 0.0, seed: int = 0) -> list[Reply]:  # fmt: skip
        """One completion per prompt; ``temperature`` 0 is greedy; ``max_new_tokens`` None: the default
        (:attr:`max_new_tokens`). A decode that outgrows the model's context or the memory is refused before it
        starts (:class:`GenerationBounds`)."""
        from rlite.engines.base import SamplingParams

        if not prompts:
            return []
        texts, ids = prompt_ids(prompts, self.tokenizer, self.prompt_format)
        longest = max(map(len, ids))
        if self.bounds is not None:
            max_new_tokens = self.bounds.new_tokens(max_new_tokens, self.max_new_tokens, longest)
            self.bounds.check(longest, len(ids), max_new_tokens, weights_loaded=True)
        max_new_tokens = max_new_tokens or self.max_new_tokens
        params = SamplingParams(
            max_new_tokens=max_new_tokens, greedy=temperature == 0.0, temperature=temperature or 1.0, seed=seed
        )
        completions = self.engine.generate([list(row) for row in ids], params)
        answers = self.tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
        return [Reply(text, answer, c.finish_reason) for text, answer, c in zip(texts, answers, completions)]


def local_engine(model, *, pad_token_id: int, eos_token_ids: list[int]) -> RolloutEngine:
    """The engine that decodes ``model`` (loaded in this process) for ``rlite chat`` and ``rlite generate``: the
    default rollout engine's, built by its registration's ``from_model``."""
    from rlite.config import RolloutConfig
    from rlite.plugin_manager import registered

    name = RolloutConfig().engine.name
    entry = registered("rollout_engine", name)
    build = entry.metadata.get("from_model")
    if build is None:
        raise ConfigError(
            f"the default rollout engine {name!r} (plugin {entry.plugin!r}) declares no from_model, so rlite "
            "cannot decode a loaded model with it (docs/plugins.md, 'Capabilities')"
        )
    return build(model, pad_token_id=pad_token_id, eos_token_ids=eos_token_ids)


def check_tokenizer(tokenizer, prompt_format: PromptFormat, source: str) -> None:
    """The tokenizer can format prompts as ``prompt_format`` says (and pads with its end token if it has no pad)."""
    if prompt_format.chat_template and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"{source}: the tokenizer has no chat template; pass --raw to give prompts as they are")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token


def formatted_prompt(prompt: str | list[dict[str, str]], tokenizer, prompt_format: PromptFormat) -> str:
    """The text the model sees for ``prompt`` (a string or chat messages), exactly as training formats it."""
    return format_prompt(prompt, tokenizer, prompt_format.chat_template, prompt_format.system_prompt)


def prompt_ids(prompts: Sequence[str | list[dict[str, str]]], tokenizer, prompt_format: PromptFormat,
               ) -> tuple[list[str], list[list[int]]]:  # fmt: skip
    """The texts of ``prompts`` and their token ids, as training tokenises (``build_prompt_set``)."""
    texts = [formatted_prompt(prompt, tokenizer, prompt_format) for prompt in prompts]
    return texts, [list(row) for row in tokenizer(texts, add_special_tokens=False)["input_ids"]]


# --------------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------------


def is_run_folder(path: Path) -> bool:
    return os.path.lexists(path / "config.yaml") and not (path / "config.json").is_file()


@contextlib.contextmanager
def open_chat_model(target: str | Path, *, raw: bool = False, dtype: str = "float32", max_new_tokens: int | None = None,
                    prompts: Sequence[str | list[dict[str, str]]] = (), batch_size: int = 1) -> Iterator[ChatModel]:
    """The model ``target`` names (a run folder or a Hugging Face folder), ready to reply. ``raw``:
    prompts go to the model as they are, never templated. A run folder is read as data
    (:func:`read_run_folder_config`): nothing its config names runs. ``max_new_tokens`` (None: the run's
    ``rollout.max_new_tokens``, else 256) and ``prompts`` (those known now, decoded ``batch_size`` at a
    time) are checked against the model's context and the memory before its weights load
    (:class:`GenerationBounds`)."""
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
            dtype, default_new_tokens = cfg.model.dtype, cfg.rollout.max_new_tokens
        elif (path / "config.json").is_file():
            model_dir, source = path, str(path)
            prompt_format, default_new_tokens = None, 256
        else:
            raise ConfigError(
                f"MODEL_OR_RUN {str(target)!r} is neither a run folder (no config.yaml) nor a Hugging Face model "
                "folder (no config.json)"
            )
        tokenizer = load_tokenizer(model_dir)
        if prompt_format is None:  # a plain model folder: templated when its tokenizer has a template
            prompt_format = PromptFormat(bool(getattr(tokenizer, "chat_template", None)) and not raw)
        check_tokenizer(tokenizer, prompt_format, source)
        bounds = generation_bounds(model_dir, dtype)
        longest = max(map(len, prompt_ids(prompts, tokenizer, prompt_format)[1]), default=1) if prompts else 1
        new_tokens = bounds.new_tokens(max_new_tokens, default_new_tokens, longest)
        bounds.check(longest, min(batch_size, max(len(prompts), 1)), new_tokens, weights_loaded=False)
        model = load_model(model_dir, dtype)
        yield ChatModel(model, tokenizer, prompt_format, source, max_new_tokens or default_new_tokens, bounds)


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
    opened without following a link (:mod:`rlite.run_files`)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from rlite.config.loader import config_from_data
    from rlite.run_files import read_run_file

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
    older one, and neither the export nor a checkpoint may hold a link (:mod:`rlite.run_files`)."""
    from rlite.run.checkpoint import MARKER, find_resume_checkpoint
    from rlite.run_files import link_in_folder, refusal

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
    from rlite.run.policy import model_state

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


def load_tokenizer(model_dir: Path):
    """The tokenizer of ``model_dir`` (an export holds the tokenizer training used): JSON, no code."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{model_dir}: cannot load a tokenizer ({exc})") from None


def load_model(model_dir: Path, dtype: str):
    """The causal LM of ``model_dir`` (on the GPU when there is one), its remote code never run."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlite.hf_models import DTYPES

    try:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=DTYPES[dtype], trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{model_dir}: cannot load a causal LM and its tokenizer ({exc})") from None
    return model.to("cuda" if torch.cuda.is_available() else "cpu")


# --------------------------------------------------------------------------------------------------
# prompt files
# --------------------------------------------------------------------------------------------------


def read_prompt_file(path: str | Path, prompt_key: str = "prompt") -> list[dict[str, Any]]:
    """Rows with the prompt under ``"prompt"``: a ``.jsonl`` file's objects (the prompt in column
    ``prompt_key``, a string or chat messages; the other columns are kept), or a ``.txt`` file's
    non-empty lines. The file must be UTF-8 text and no prompt may hold a NUL (:func:`check_prompt_text`)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--prompts: {str(path)!r} not found")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(f"--prompts: {path} line {line} is not UTF-8 text ({exc.reason}); rlite reads UTF-8") from None
    lines = text.splitlines()
    if path.suffix == ".txt":
        rows = []
        for number, line in enumerate(lines, start=1):
            if line.strip():
                check_prompt_text(line, f"--prompts: {path} line {number}")
                rows.append({"prompt": line})
        return rows
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
        check_prompt_text(row[prompt_key], f"--prompts: {path} line {number}")
        rows.append({**row, "prompt": row[prompt_key]})
    if not rows:
        raise ConfigError(f"--prompts: {path} holds no prompts")
    return rows


def check_prompt_text(prompt: Any, where: str) -> None:
    """A prompt is a string, or chat messages whose contents are strings, without a NUL character: a NUL is
    no text a model reads (a binary file given by mistake), and a tokenizer turns it into whatever it likes."""
    if isinstance(prompt, list) and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in prompt):
        texts = [m["content"] for m in prompt]
    elif isinstance(prompt, str):
        texts = [prompt]
    else:
        raise ConfigError(f"{where}: the prompt must be a string or a list of chat messages with string contents, "
                          f"got {type(prompt).__name__}")
    if any("\x00" in text for text in texts):
        raise ConfigError(f"{where} holds a NUL character, which is no text a model reads; remove it")
