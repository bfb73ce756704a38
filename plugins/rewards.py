"""Built-in plugin: reward functions (``rewards[*].name``).

Every function has the signature ``fn(completion, sample, cfg) -> float``: the decoded completion,
the data row (with ``"answer"``) and the function's config instance. Every config has
``weight: float = 1.0``, the function's weight in the sum over ``rewards``. ``exact_match``,
``numeric`` and ``overlong_penalty`` cannot hang and run inline in the trainer; ``math_verify`` and
``python`` run in the reward runner's worker processes, killed and replaced at the deadline.

* ``exact_match``: 1.0 when the completion, cut at the first end-of-turn text and stripped of
  whitespace, equals ``str(answer)``; else 0.0.
* ``numeric``: 1.0 when the last (or first) number in the completion is within ``tolerance`` of the
  answer read as a number; else 0.0.
* ``math_verify``: 1.0 when the ``math-verify`` package judges the completion's final expression
  equal to the answer (LaTeX or plain); needs ``pip install rlite[math]``.
* ``reward_model``: a Hugging Face sequence-classification model (a local folder) scores each
  prompt + completion, batched, in the trainer's process.
* ``python``: your function, ``path/to/file.py:fn`` or ``package.module:fn``, called as
  ``fn(completion, sample, **kwargs) -> float``, or with ``batched: true`` as
  ``fn(completions, **columns, **kwargs) -> list[float]`` (TRL's form); its signature is checked
  against the first data row before training starts.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlite.api import ConfigError, hookimpl, require_optional_package

END_TEXTS = ["<|im_end|>", "<|endoftext|>"]
"""End-of-turn texts that may be left in a decoded completion; everything from the first one is cut."""

# A number, with an optional sign when the minus does not follow a word character (so "12-5" reads
# as 12 and 5, while "is -5" reads as -5), optional thousands separators, and optional decimals.
NUMBER_RE = re.compile(r"(?:(?<![\w.])-)?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")


def cut_at_end_texts(text: str, end_texts: list[str]) -> str:
    """``text`` up to the first occurrence of any of ``end_texts``."""
    for end in end_texts:
        position = text.find(end)
        if position != -1:
            text = text[:position]
    return text


def find_numbers(text: str) -> list[float]:
    """Every number in ``text``, in order (``"1,234.5"`` -> 1234.5)."""
    return [float(match.replace(",", "")) for match in NUMBER_RE.findall(text)]


# --------------------------------------------------------------------------------------------------
# exact_match
# --------------------------------------------------------------------------------------------------


@dataclass
class ExactMatchConfig:
    """Options of ``exact_match``."""

    weight: float = 1.0
    """Weight of this function in the summed reward."""
    strip: bool = True
    """Strip surrounding whitespace from the completion and the answer before comparing."""
    end_texts: list[str] = field(default_factory=lambda: list(END_TEXTS))
    """The completion is cut at the first of these texts (end-of-turn markers kept by the decoder)."""
    case_sensitive: bool = True
    """Compare with case; False lower-cases both sides."""


def exact_match(completion: str, sample: dict, cfg: ExactMatchConfig) -> float:
    """1.0 when the cleaned completion equals the answer string, else 0.0."""
    predicted = cut_at_end_texts(completion, cfg.end_texts)
    answer = str(sample["answer"])
    if cfg.strip:
        predicted, answer = predicted.strip(), answer.strip()
    if not cfg.case_sensitive:
        predicted, answer = predicted.lower(), answer.lower()
    return 1.0 if predicted == answer else 0.0


# --------------------------------------------------------------------------------------------------
# numeric
# --------------------------------------------------------------------------------------------------


@dataclass
class NumericConfig:
    """Options of ``numeric``."""

    weight: float = 1.0
    """Weight of this function in the summed reward."""
    tolerance: float = 1e-6
    """Largest absolute difference between the number found and the answer that still scores 1."""
    position: str = "last"
    """Which number of the completion is its answer: ``last`` or ``first``."""
    end_texts: list[str] = field(default_factory=lambda: list(END_TEXTS))
    """The completion is cut at the first of these texts before numbers are read."""

    def __post_init__(self) -> None:
        if self.position not in ("last", "first"):
            raise ConfigError(f"position: invalid value {self.position!r}. Valid choices: last, first.")
        if self.tolerance < 0:
            raise ConfigError(f"tolerance must be >= 0, got {self.tolerance}")


def _answer_number(answer: Any) -> float:
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        return float(answer)
    text = str(answer).strip()
    try:
        return float(text.replace(",", ""))
    except ValueError:
        numbers = find_numbers(text)  # for answers like "#### 42" or "$42"
        if not numbers:
            raise ValueError(f"the answer {text!r:.100} holds no number") from None
        return numbers[-1]


def numeric(completion: str, sample: dict, cfg: NumericConfig) -> float:
    """1.0 when the completion's last (or first) number is within ``tolerance`` of the answer."""
    target = _answer_number(sample["answer"])
    found = find_numbers(cut_at_end_texts(completion, cfg.end_texts))
    if not found:
        return 0.0
    predicted = found[-1] if cfg.position == "last" else found[0]
    return 1.0 if abs(predicted - target) <= cfg.tolerance else 0.0


# --------------------------------------------------------------------------------------------------
# math_verify
# --------------------------------------------------------------------------------------------------


@dataclass
class MathVerifyConfig:
    """Options of ``math_verify`` (needs the optional ``math-verify`` package)."""

    weight: float = 1.0
    """Weight of this function in the summed reward."""
    end_texts: list[str] = field(default_factory=lambda: list(END_TEXTS))
    """The completion is cut at the first of these texts before it is parsed."""

    def __post_init__(self) -> None:
        require_optional_package("math_verify", "the math_verify reward needs the math-verify package: pip install "
                                 "'rlite[math]' (in a clone: pip install -e '.[math]')")


class _DropTimeoutNotice(logging.Filter):
    """math-verify warns that its own timeout is off; the reward runner enforces one instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


_NOTICE_FILTER = _DropTimeoutNotice()


def math_verify(completion: str, sample: dict, cfg: MathVerifyConfig) -> float:
    """1.0 when math-verify finds the completion's answer equal to the reference, else 0.0."""
    from math_verify import parse, verify

    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_NOTICE_FILTER)  # idempotent: a filter is added once
    # the reward runner's deadline (a worker process killed) covers math-verify's own timeouts
    answer = str(sample["answer"])
    gold = parse(answer, parsing_timeout=None)
    if not gold:
        gold = parse(f"${answer}$", parsing_timeout=None)
    predicted = parse(cut_at_end_texts(completion, cfg.end_texts), parsing_timeout=None)
    if not gold or not predicted:
        return 0.0
    return 1.0 if verify(gold, predicted, timeout_seconds=None) else 0.0


# --------------------------------------------------------------------------------------------------
# python
# --------------------------------------------------------------------------------------------------


_FILE_MODULES: dict[str, Any] = {}
"""Modules loaded from a file path, by absolute path: each file is executed once per process."""


def _load_file(file: str, path: str) -> Any:
    location = os.path.abspath(file)
    if location in _FILE_MODULES:
        return _FILE_MODULES[location]
    if not os.path.isfile(location):
        raise ConfigError(f"function: {path!r}: the file {location} does not exist (a relative path is read from "
                          f"the working folder, {os.getcwd()})")
    name = "rlite_user_reward_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(location))[0])
    spec = importlib.util.spec_from_file_location(name, location)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - anything the user's file raises on import
        raise ConfigError(f"function: {path!r}: loading {location} failed: {type(exc).__name__}: {exc}") from None
    _FILE_MODULES[location] = module
    return module


def resolve_function(path: str) -> Callable[..., Any]:
    """The function of ``path/to/file.py:attr`` or ``package.module:attr`` (``attr`` may be dotted),
    checked to be callable. A file is loaded once per process; a module is imported."""
    module_name, sep, attr = path.rpartition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"function: {path!r} must look like 'path/to/file.py:function' or 'package.module:function'")
    if module_name.endswith(".py") or "/" in module_name or os.sep in module_name:
        target: Any = _load_file(module_name, path)
    else:
        try:
            target = importlib.import_module(module_name)
        except ImportError as exc:
            raise ConfigError(f"function: cannot import module {module_name!r} of {path!r}: {exc}") from None
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"function: {path!r}: {module_name!r} has no attribute {attr!r}{_candidates(target, part)}")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"function: {path!r} is a {type(target).__name__}, not a callable")
    return target


def _candidates(target: Any, missing: str) -> str:
    """`` Did you mean 'x'? Its functions: a, b`` for a module (or class) that lacks ``missing``: the
    public callables defined in it, not the ones it imported."""
    home = getattr(target, "__name__", None)
    names = sorted(
        name for name, value in vars(target).items()
        if not name.startswith("_") and callable(value) and getattr(value, "__module__", home) == home
    )  # fmt: skip
    if not names:
        return ". It defines no public function"
    close = difflib.get_close_matches(missing, names, n=1)
    return (f". Did you mean {close[0]!r}?" if close else "") + f" Its functions: {', '.join(names)}"


@dataclass
class PythonRewardConfig:
    """Options of ``python``: a reward function of your own, by file path or module."""

    function: str = ""
    """``path/to/file.py:function`` (a relative path is read from the working folder) or
    ``package.module:function``."""
    batched: bool = False
    """False: called once per completion as ``function(completion, sample, **kwargs) -> float``, with
    the data row as ``sample``. True: called once per batch as ``function(completions, **columns,
    **kwargs) -> list[float]``, every column of the data rows a keyword argument holding a list
    (``prompt``, ``answer``, ..., ``response_length``, ``finish_reason``; ``prompts`` too, TRL's name)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for the function."""
    weight: float = 1.0
    """Weight of this function in the summed reward."""

    def __post_init__(self) -> None:
        if not self.function:
            raise ConfigError("function: set it to 'path/to/file.py:function' or 'package.module:function'")
        resolve_function(self.function)


def _columns(samples: list[dict]) -> dict[str, list[Any]]:
    """The data rows as columns (a key missing from a row gives None there), with TRL's ``prompts``."""
    keys = list(dict.fromkeys(key for sample in samples for key in sample))
    columns = {key: [sample.get(key) for sample in samples] for key in keys}
    if "prompt" in columns and "prompts" not in columns:
        columns["prompts"] = columns["prompt"]
    return columns


def python(completion: str | list[str], sample: dict | list[dict], cfg: PythonRewardConfig) -> Any:
    """Call the configured function on one completion, or with ``batched`` on the whole batch."""
    fn = resolve_function(cfg.function)
    if cfg.batched:
        return fn(completion, **_columns(sample), **cfg.kwargs)
    return fn(completion, sample, **cfg.kwargs)


python.reward_source = lambda cfg: resolve_function(cfg.function)  # whose return lines a bad value points at


def _where(fn: Callable[..., Any]) -> str:
    try:
        return f"{inspect.getsourcefile(fn)}, line {inspect.getsourcelines(fn)[1]}"
    except (TypeError, OSError):
        return repr(fn)


def check_python_reward(cfg: PythonRewardConfig, sample: dict) -> None:
    """Check, before training starts, that the function can be called the way ``cfg`` says on
    ``sample`` (a data row as the function will see it); raise ConfigError naming the function, its
    file and the signature it needs."""
    fn = resolve_function(cfg.function)
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin or extension callable: nothing to check
    columns = _columns([sample])
    clash = sorted(set(cfg.kwargs) & set(columns)) if cfg.batched else []
    if clash:
        raise ConfigError(f"args.kwargs: {', '.join(clash)} also name data columns, which a batched function "
                          "receives as keyword arguments; rename the kwargs")
    try:
        if cfg.batched:
            signature.bind(["completion"], **columns, **cfg.kwargs)
        else:
            signature.bind("completion", sample, **cfg.kwargs)
    except TypeError as exc:
        names = list(signature.parameters)
        if cfg.batched:
            expected = (f"{fn.__name__}(completions: list[str], **columns) -> list[float], the columns being "
                        f"{', '.join(columns)}" + (f", plus the kwargs {', '.join(cfg.kwargs)}" if cfg.kwargs else ""))
            hint = " It looks like a per-completion function: drop args.batched." if names[:2] == ["completion", "sample"] else ""
        else:
            expected = f"{fn.__name__}(completion: str, sample: dict" + "".join(
                f", {key}=..." for key in cfg.kwargs) + ") -> float"
            hint = (" It looks like a batched function: set args.batched: true."
                    if names and names[0] in ("completions", "prompts") else "")
        raise ConfigError(
            f"args.function: {cfg.function!r} ({fn.__qualname__} in {_where(fn)}) cannot be called as {expected} "
            f"on a data row: {exc}.{hint}"
        ) from None


@dataclass
class OverlongPenaltyConfig:
    """Options of ``overlong_penalty`` (DAPO's soft overlong punishment)."""

    weight: float = 1.0
    """Weight of this function in the summed reward."""
    max_length: int = 0
    """L: the maximum response length in tokens (0 = ``rollout.max_new_tokens`` is not known here, so set it)."""
    buffer: int = 0
    """L_c: the soft buffer before L in which the penalty grows linearly from 0 to -1."""

    def __post_init__(self) -> None:
        if self.max_length <= 0 or not 0 < self.buffer <= self.max_length:
            raise ConfigError(
                f"max_length must be positive and buffer in (0, max_length], got max_length={self.max_length}, "
                f"buffer={self.buffer}"
            )


def overlong_penalty(completion: str, sample: dict, cfg: OverlongPenaltyConfig) -> float:
    """DAPO (arXiv 2503.14476, eq. 13): with |y| the response length in tokens,
    0 if |y| <= L - L_c; ((L - L_c) - |y|) / L_c inside the buffer; -1 beyond L.

    Needs ``sample["response_length"]``, which rlite adds to every sample it scores
    (:func:`rlite.reward_runner.reward_samples`)."""
    if "response_length" not in sample:
        raise KeyError("overlong_penalty needs sample['response_length'] (set by the rlite training loop)")
    length = int(sample["response_length"])
    start = cfg.max_length - cfg.buffer
    if length <= start:
        return 0.0
    if length <= cfg.max_length:
        return (start - length) / cfg.buffer
    return -1.0


# --------------------------------------------------------------------------------------------------
# reward_model
# --------------------------------------------------------------------------------------------------

DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class RewardModelConfig:
    """Options of ``reward_model``: a Hugging Face sequence-classification model scores prompt + completion."""

    path: str = ""
    """Local folder of an ``AutoModelForSequenceClassification`` and its tokenizer."""
    weight: float = 1.0
    """Weight of this function in the summed reward."""
    label: int = 0
    """With one output (a reward model), the reward is its logit; with several (a classifier), the
    softmax probability of this label."""
    batch_size: int = 16
    """Prompt + completion texts scored per forward pass."""
    max_length: int = 1024
    """Tokens of prompt + completion kept (the start is cut when longer, so the completion stays)."""
    device: str = "auto"
    """``auto``: the trainer's current CUDA device when there is one, else ``cpu``; or a torch device."""
    dtype: str = "float32"
    """The model's dtype: float32, bfloat16 or float16."""
    chat_template: bool = True
    """Format the prompt (text or chat messages) and the completion as a user and an assistant turn
    with the reward model's chat template, when its tokenizer has one; else prompt + completion."""

    def __post_init__(self) -> None:
        if not self.path:
            raise ConfigError("path: set it to the local folder of a sequence-classification model")
        if not os.path.isdir(self.path):
            raise ConfigError(f"path: the folder {os.path.abspath(self.path)} does not exist")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype: invalid value {self.dtype!r}. Valid choices: {', '.join(DTYPES)}.")
        if self.batch_size < 1 or self.max_length < 2:
            raise ConfigError(f"need batch_size >= 1 and max_length >= 2, got {self.batch_size} and {self.max_length}")


_REWARD_MODELS: dict[tuple[str, str, str], tuple[Any, Any, Any]] = {}
"""Loaded reward models, by (folder, device, dtype): each loads once per process."""


def _reward_model(cfg: RewardModelConfig) -> tuple[Any, Any, Any]:
    """``(model, tokenizer, device)`` of ``cfg``, loaded on first use."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    if cfg.device == "auto":
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    else:
        device = torch.device(cfg.device)
    key = (os.path.abspath(cfg.path), str(device), cfg.dtype)
    if key not in _REWARD_MODELS:
        tokenizer = AutoTokenizer.from_pretrained(cfg.path)
        model = AutoModelForSequenceClassification.from_pretrained(cfg.path, dtype=getattr(torch, cfg.dtype))
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        if model.config.pad_token_id is None:  # the model finds each row's last token through it
            model.config.pad_token_id = tokenizer.pad_token_id
        tokenizer.padding_side, tokenizer.truncation_side = "right", "left"
        _REWARD_MODELS[key] = (model.to(device).eval(), tokenizer, device)
    return _REWARD_MODELS[key]


def _reward_model_text(tokenizer, prompt: Any, completion: str, chat_template: bool) -> str:
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": "" if prompt is None else str(prompt)}]
    if chat_template and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": completion}], tokenize=False)
    return "\n".join(str(m.get("content", "")) for m in messages) + completion


def reward_model(completions: list[str], samples: list[dict], cfg: RewardModelConfig) -> list[float]:
    """The reward model's score of each prompt + completion (batched): the logit of a one-output
    model, else the softmax probability of ``label``."""
    import torch

    model, tokenizer, device = _reward_model(cfg)
    texts = [_reward_model_text(tokenizer, s.get("prompt"), c, cfg.chat_template) for c, s in zip(completions, samples)]
    scores: list[float] = []
    with torch.no_grad():
        for start in range(0, len(texts), cfg.batch_size):
            batch = tokenizer(texts[start : start + cfg.batch_size], padding=True, truncation=True,
                              max_length=cfg.max_length, return_tensors="pt").to(device)
            logits = model(**batch).logits.float()
            values = logits[:, 0] if logits.shape[-1] == 1 else logits.softmax(-1)[:, cfg.label]
            scores.extend(values.tolist())
    return scores


def check_reward_model(cfg: RewardModelConfig, sample: dict) -> None:
    """Load the model before training starts and score ``sample`` once."""
    try:
        model, _, _ = _reward_model(cfg)
    except Exception as exc:  # noqa: BLE001 - whatever transformers says about the folder
        raise ConfigError(f"args.path: {cfg.path} does not load as a sequence-classification model: "
                          f"{type(exc).__name__}: {exc}") from None
    labels = model.config.num_labels
    if labels > 1 and not 0 <= cfg.label < labels:
        raise ConfigError(f"args.label: {cfg.label} is not a label of {cfg.path} (it has {labels})")
    reward_model([""], [sample], cfg)


def _batched(cfg: PythonRewardConfig) -> bool:
    return cfg.batched


@hookimpl
def register_reward_functions(register) -> None:
    # pure functions that cannot hang run inline; what may take unbounded time runs in worker processes
    register("exact_match", exact_match, ExactMatchConfig, isolation="inline")
    register("numeric", numeric, NumericConfig, isolation="inline")
    register("math_verify", math_verify, MathVerifyConfig, isolation="process")
    register("python", python, PythonRewardConfig, isolation="process", batched=_batched, check=check_python_reward)
    register("overlong_penalty", overlong_penalty, OverlongPenaltyConfig, isolation="inline")
    # a fixed model's forward pass cannot hang, and the model stays loaded in the trainer's process
    register("reward_model", reward_model, RewardModelConfig, isolation="inline", batched=True, check=check_reward_model)
