"""Prompts: loading them (a synthetic task or files), tokenising them, and handing them out per step.

:func:`load_prompt_splits` turns ``data.*`` into a training :class:`PromptSet` and an optional held-out
one. Files (.jsonl/.json, .parquet, folders of them, globs and lists of all these, or a folder written
by ``datasets.Dataset.save_to_disk``) are read with the ``datasets`` library, in memory and with a
throw-away cache folder so that nothing piles up under ``HF_HOME``; a file that is not UTF-8 or a
JSON line that does not parse is reported with its file and 1-based line. The prompt and answer
columns may be dotted paths into nested columns (``reward_model.ground_truth``). Each row's prompt (a
string or a list of chat messages) is wrapped with the tokenizer's chat template when
``data.chat_template`` is true, then tokenised without special tokens; rows whose prompt is empty and
prompts longer than ``data.max_prompt_tokens`` are dropped and counted (a warning names the first
empty one). Row numbers in messages are 1-based within their file.

:class:`PromptSampler` yields each step's prompts for one rank: the global batch of
``prompts_per_step`` prompts is cut into ``world_size`` equal contiguous slices. The prompt order is
an endless stream of epochs, each a permutation drawn from ``(seed, epoch)``; its position is the
whole state, so a resumed run sees exactly the prompts an uninterrupted one would.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rlite.config import DataConfig
from rlite.tasks import make_task

logger = logging.getLogger(__name__)

FILE_LOADERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
"""File extension -> ``datasets`` builder name."""
EVAL_SPLIT_NAMES = ("test", "validation", "eval")


@dataclass
class PromptItem:
    """One prompt, ready for the rollout engine."""

    index: int
    """Position of the row in its source (file row or generated row), before any were dropped."""
    prompt_ids: list[int]
    """Token ids of ``prompt_text`` (no special tokens added beyond those the chat template wrote)."""
    prompt_text: str
    """The text the model sees: the prompt after the chat template, if one is applied."""
    row: dict[str, Any]
    """The data row, with the prompt under ``"prompt"`` and the reference answer under ``"answer"``."""


@dataclass
class PromptSet(Sequence):
    """The tokenised prompts of one split."""

    items: list[PromptItem]
    """Kept prompts, in source order."""
    source: str
    """Where they came from (a path or ``task:<name>``), for messages."""
    num_dropped: int = 0
    """Prompts dropped for being longer than ``data.max_prompt_tokens``."""
    columns: list[str] = field(default_factory=list)
    """Columns of the source rows."""

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i):  # type: ignore[override]
        return self.items[i]

    def __iter__(self) -> Iterator[PromptItem]:
        return iter(self.items)


# --------------------------------------------------------------------------------------------------
# reading rows
# --------------------------------------------------------------------------------------------------


GLOB_CHARS = ("*", "?", "[")


def is_saved_dataset(path: Path) -> bool:
    """A folder written by ``datasets.Dataset.save_to_disk`` (or ``DatasetDict.save_to_disk``)."""
    return (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file() or (
        path / "state.json"
    ).is_file()


def _where_read(path: str) -> str:
    """Where a relative data path is looked for: the folder the command runs in, not the config's folder."""
    if Path(path).is_absolute():
        return ""
    return f" (relative paths are read from the working folder, {os.getcwd()}, not from the config file's folder)"


def resolve_data_files(spec: str | Sequence[str], key: str) -> list[Path]:
    """The data sources a ``data.*_files`` setting names, in order, each checked to exist.

    ``spec`` is a path or a list of paths; each may be a glob (``data/train-*.parquet``,
    ``shards/**/*.jsonl``; sorted), a file (.jsonl/.json/.parquet), a folder written by
    ``datasets.save_to_disk`` (kept as one source) or any other folder, which stands for the data
    files under it (sorted, searched recursively: a parquet folder). Raises ``FileNotFoundError``
    naming ``key`` for a path that does not exist or a glob or folder that holds no data file.
    """
    import glob

    entries = [spec] if isinstance(spec, (str, Path)) else list(spec)
    if not entries:
        raise FileNotFoundError(f"{key}: the list of files is empty")
    sources: list[Path] = []
    for entry in entries:
        text = str(Path(str(entry)).expanduser())
        if any(ch in text for ch in GLOB_CHARS):
            matches = sorted(Path(m) for m in glob.glob(text, recursive=True))
            if not matches:
                raise FileNotFoundError(f"{key}: {text!r} matches no file{_where_read(text)}")
            sources.extend(matches)
            continue
        path = Path(text)
        if not path.exists():
            raise FileNotFoundError(f"{key}: {text!r} does not exist{_where_read(text)}")
        sources.append(path)
    resolved: list[Path] = []
    for path in sources:
        if path.is_dir() and not is_saved_dataset(path):
            files = sorted(f for f in path.rglob("*") if f.is_file() and f.suffix.lower() in FILE_LOADERS)
            if not files:
                raise FileNotFoundError(
                    f"{key}: folder {str(path)!r} holds no {', '.join(FILE_LOADERS)} file and was not written by "
                    "datasets.save_to_disk"
                )
            resolved.extend(files)
        elif path.is_file() and path.suffix.lower() not in FILE_LOADERS:
            raise ValueError(
                f"{key}: cannot read {str(path)!r}: unsupported extension {path.suffix!r}. Use "
                f"{', '.join(FILE_LOADERS)}, a folder of such files, or a folder written by datasets.save_to_disk."
            )
        else:
            resolved.append(path)
    return resolved


@dataclass
class DataRows:
    """Rows read from one or more sources, and where each came from (for messages)."""

    rows: list[dict[str, Any]]
    sources: list[tuple[Path, int | None]]
    """``(file or folder, number of its rows)`` in order; a count is filled in when first needed."""

    def where(self, index: int) -> str:
        """``'path' row N`` (N 1-based within its file) of the row at ``index``."""
        offset = 0
        for i, (path, count) in enumerate(self.sources):
            if count is None:
                count = _count_rows(path)
                self.sources[i] = (path, count)
            if index < offset + count or i == len(self.sources) - 1:
                return f"{str(path)!r} row {index - offset + 1}"
            offset += count
        return f"row {index + 1}"


def _count_rows(path: Path) -> int:
    """Rows ``datasets`` reads from one data file: non-blank lines of JSON lines, entries of a JSON
    array, rows of a parquet file."""
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    text = path.read_text(encoding="utf-8")
    stripped = text.lstrip()
    if stripped.startswith("["):
        return len(json.loads(text))
    return sum(1 for line in text.splitlines() if line.strip())


def read_rows(spec: str | Sequence[str] | Path, key: str, split: str = "train") -> DataRows:
    """Read every source of a ``data.*_files`` setting (:func:`resolve_data_files`) into row dicts.

    Data files of one format are read by one ``datasets.load_dataset`` call; a ``save_to_disk``
    folder with ``datasets.load_from_disk``, picking ``split`` from a ``DatasetDict`` (``"eval"``
    tries test, validation, eval). ``key`` names the setting in error messages; a file that is not
    UTF-8 or a JSON line that does not parse is reported with its file and 1-based line.
    """
    import datasets

    paths = resolve_data_files(spec, key)
    progress_was_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    rows: list[dict[str, Any]] = []
    sources: list[tuple[Path, int | None]] = []
    try:
        # consecutive files of one format go through one load_dataset call; folders one by one
        groups: list[tuple[str | None, list[Path]]] = []
        for path in paths:
            builder = None if path.is_dir() else FILE_LOADERS[path.suffix.lower()]
            if builder is not None and groups and groups[-1][0] == builder:
                groups[-1][1].append(path)
            else:
                groups.append((builder, [path]))
        for builder, group in groups:
            if builder is None:
                part = _load_saved_folder(group[0], key, split).to_list()
                sources.append((group[0], len(part)))
            else:
                part = _load_files(builder, group, key)
                sources.extend((path, len(part) if len(group) == 1 else None) for path in group)
            rows.extend(part)
    finally:
        if progress_was_on:
            datasets.enable_progress_bars()
    if not rows:
        where = str(paths[0]) if len(paths) == 1 else f"{len(paths)} files"
        raise ValueError(f"{key}: {where!r} holds no rows")
    return DataRows(rows, sources)


def _load_files(builder: str, files: list[Path], key: str) -> list[dict[str, Any]]:
    import datasets

    files = [f for f in files if not _is_blank(f)]
    if not files:
        return []
    # keep_in_memory alone still writes an Arrow copy under HF_HOME; a temporary cache folder is
    # removed as soon as the rows are in memory.
    with tempfile.TemporaryDirectory(prefix="rlite-data-") as cache_dir:
        try:
            dataset = datasets.load_dataset(
                builder, data_files=[str(f) for f in files], split="train", keep_in_memory=True, cache_dir=cache_dir
            )
            return dataset.to_list()
        except Exception as exc:  # datasets and pyarrow raise many kinds: find the file and line
            if builder == "json":
                for file in files:
                    _check_json_file(file, key)
            names = str(files[0]) if len(files) == 1 else f"{len(files)} files from {str(files[0])!r}"
            cause = exc.__cause__ or exc
            raise ValueError(f"{key}: cannot read {names!r} as {builder}: {str(cause).splitlines()[0]}") from exc


def _check_json_file(path: Path, key: str) -> None:
    """Raise ``ValueError`` naming the file and 1-based line of the first non-UTF-8 byte or (for
    JSON lines) the first line that does not parse."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise ValueError(
            f"{key}: {str(path)!r} line {line}, column {column}: byte 0x{data[exc.start]:02x} is not UTF-8; "
            "save the file as UTF-8"
        ) from None
    if text.lstrip().startswith(("[", "{")) and not path.suffix.lower() == ".jsonl":
        try:
            json.loads(text)
            return
        except json.JSONDecodeError as exc:
            if text.lstrip().startswith("["):
                raise ValueError(
                    f"{key}: {str(path)!r} line {exc.lineno}, column {exc.colno}: not valid JSON ({exc.msg})"
                ) from None
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"{key}: {str(path)!r} line {number}, column {exc.colno}: not valid JSON ({exc.msg})"
            ) from None


def _is_blank(path: Path) -> bool:
    """True for an empty or whitespace-only file (which ``datasets`` reports obscurely)."""
    with path.open("rb") as handle:
        head = handle.read(4096)
    return not head.strip() and path.stat().st_size <= 4096


def _load_saved_folder(path: Path, key: str, split: str):
    import datasets

    try:
        dataset = datasets.load_from_disk(str(path), keep_in_memory=True)
    except FileNotFoundError as exc:
        raise ValueError(
            f"{key}: {str(path)!r} is a folder but not one written by datasets.save_to_disk ({exc})"
        ) from None
    if isinstance(dataset, datasets.DatasetDict):
        names = list(dataset)
        wanted = EVAL_SPLIT_NAMES if split == "eval" else (split,)
        chosen = next((n for n in wanted if n in dataset), names[0] if len(names) == 1 else None)
        if chosen is None:
            raise ValueError(
                f"{key}: {str(path)!r} holds splits {', '.join(names)}; expected one of {', '.join(wanted)}"
            )
        dataset = dataset[chosen]
    return dataset


# --------------------------------------------------------------------------------------------------
# tokenising
# --------------------------------------------------------------------------------------------------


def _as_messages(prompt: Any) -> list[dict[str, str]] | None:
    """The prompt as chat messages, or None when it is a plain string."""
    if isinstance(prompt, str):
        return None
    if isinstance(prompt, Sequence) and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in prompt
    ):
        return [dict(m) for m in prompt]
    raise TypeError(f"a prompt must be a string or a list of {{role, content}} messages, got {prompt!r:.200}")


def format_prompt(prompt: Any, tokenizer, chat_template: bool, system_prompt: str | None = None) -> str:
    """The text the model sees for one prompt (a string or a list of chat messages).

    With ``chat_template`` a string becomes one user message, ``system_prompt`` is put first unless
    the conversation already starts with a system message, and the template ends with the
    generation prompt. Without it the string is used as is.
    """
    messages = _as_messages(prompt)
    if not chat_template:
        if messages is not None:
            raise ValueError(
                "data.chat_template is false but the prompt is a list of chat messages; set it to true"
            )
        return prompt
    if messages is None:
        messages = [{"role": "user", "content": prompt}]
    if system_prompt is not None and (not messages or messages[0]["role"] != "system"):
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def column_value(row: dict[str, Any], column: str) -> Any:
    """``row[column]``, or for a dotted ``column`` not in the row the nested value
    (``reward_model.ground_truth`` is ``row["reward_model"]["ground_truth"]``); ``KeyError`` naming
    the part that is missing."""
    if column in row:
        return row[column]
    node: Any = row
    parts = column.split(".")
    for depth, part in enumerate(parts):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, (list, tuple)) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            where = ".".join(parts[:depth]) or "the row"
            present = ", ".join(map(str, node)) if isinstance(node, dict) else type(node).__name__
            raise KeyError(f"{where} has no {part!r} (it holds: {present})")
    return node


def _is_empty_prompt(prompt: Any) -> bool:
    if isinstance(prompt, str):
        return not prompt.strip()
    if isinstance(prompt, Sequence):
        return not any(isinstance(m, dict) and str(m.get("content") or "").strip() for m in prompt)
    return False


def build_prompt_set(
    rows: Sequence[dict[str, Any]],
    tokenizer,
    *,
    source: str,
    key: str,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    chat_template: bool = True,
    system_prompt: str | None = None,
    max_prompt_tokens: int = 256,
    where: Callable[[int], str] | None = None,
) -> PromptSet:
    """Format and tokenise ``rows`` into a :class:`PromptSet`, dropping empty and over-long prompts.

    ``key`` names the setting the rows came from and ``where(i)`` names row ``i`` (default
    ``source row i+1``) in error messages. ``prompt_key`` and ``answer_key`` may be dotted paths into
    nested columns (``reward_model.ground_truth``). Each item's row gets the prompt under ``"prompt"``
    and the answer under ``"answer"`` whatever the source columns are called.
    """
    if not rows:
        raise ValueError(f"{key}: {source} holds no rows")
    where = where or (lambda i: f"{source} row {i + 1}")
    columns = list(rows[0])
    check_columns(rows[0], source=source, key=key, prompt_key=prompt_key, answer_key=answer_key)
    if chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError("data.chat_template is true but the tokenizer has no chat template; set it to false")
    kept = formatted_prompts(rows, tokenizer, source=source, key=key, prompt_key=prompt_key, answer_key=answer_key,
                             chat_template=chat_template, system_prompt=system_prompt, where=where)
    items = tokenized_items(rows, kept, tokenizer, source=source, max_prompt_tokens=max_prompt_tokens)
    if not items:
        if not kept:
            raise ValueError(f"{key}: every prompt of {source} is empty (column {prompt_key!r})")
        raise ValueError(
            f"{key}: every prompt of {source} is longer than data.max_prompt_tokens={max_prompt_tokens}"
        )
    logger.info("%s: %d prompts", source, len(items))
    return PromptSet(items=items, source=source, num_dropped=len(rows) - len(items), columns=columns)


def check_columns(first: dict[str, Any], *, source: str, key: str, prompt_key: str, answer_key: str) -> None:
    """The prompt and answer columns (dotted paths into nested columns too) are in the ``first`` row."""
    columns = list(first)
    for column, setting in ((prompt_key, "data.prompt_key"), (answer_key, "data.answer_key")):
        try:
            column_value(first, column)
        except KeyError as exc:
            nested = f": {exc.args[0]}" if "." in column and column.split(".")[0] in columns else ""
            raise ValueError(
                f"{key}: {source} has no column {column!r} ({setting}){nested}. Columns present: {', '.join(columns)}."
            ) from None


def formatted_prompts(
    rows: Sequence[dict[str, Any]], tokenizer, *, source: str, key: str, prompt_key: str, answer_key: str,
    chat_template: bool, system_prompt: str | None, where: Callable[[int], str],
) -> list[tuple[int, Any, Any, str]]:
    """``(row index, prompt, answer, text)`` of every row whose prompt is not empty (the empty ones are counted
    in a warning); ``text``: the prompt as the model sees it (:func:`format_prompt`)."""
    kept: list[tuple[int, Any, Any, str]] = []
    empty: list[int] = []
    for i, row in enumerate(rows):
        try:
            prompt, answer = column_value(row, prompt_key), column_value(row, answer_key)
        except KeyError as exc:
            raise ValueError(f"{key}: {where(i)}: {exc.args[0]}") from None
        if answer is None:
            raise ValueError(f"{key}: {where(i)} has no value in column {answer_key!r}")
        if prompt is None or _is_empty_prompt(prompt):
            empty.append(i)
            continue
        try:
            text = format_prompt(prompt, tokenizer, chat_template, system_prompt)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{key}: {where(i)}, column {prompt_key!r}: {exc}") from None
        kept.append((i, prompt, answer, text))
    if empty:
        logger.warning(
            "%s: dropped %d of %d rows whose prompt (%s) is empty, the first at %s",
            source, len(empty), len(rows), prompt_key, where(empty[0]),
        )  # fmt: skip
    return kept


def tokenized_items(rows: Sequence[dict[str, Any]], kept: list[tuple[int, Any, Any, str]], tokenizer, *,
                    source: str, max_prompt_tokens: int) -> list[PromptItem]:
    """The ``kept`` prompts tokenised, those over ``max_prompt_tokens`` dropped (counted in a warning); each
    item's row gets the prompt under ``"prompt"`` and the answer under ``"answer"``."""
    all_ids = tokenizer([text for *_, text in kept], add_special_tokens=False)["input_ids"] if kept else []
    items = []
    too_long = 0
    for (i, prompt, answer, text), ids in zip(kept, all_ids):
        if len(ids) > max_prompt_tokens:
            too_long += 1
            continue
        full_row = dict(rows[i])
        full_row["prompt"] = prompt
        full_row["answer"] = answer
        items.append(PromptItem(index=i, prompt_ids=list(ids), prompt_text=text, row=full_row))
    if too_long:
        logger.warning(
            "%s: dropped %d of %d prompts longer than data.max_prompt_tokens=%d",
            source,
            too_long,
            len(rows),
            max_prompt_tokens,
        )
    return items


def _describe(spec: str | Sequence[str]) -> str:
    return str(spec) if isinstance(spec, (str, Path)) else ", ".join(map(str, spec))


def load_prompt_splits(cfg: DataConfig, tokenizer) -> tuple[PromptSet, PromptSet | None]:
    """Load ``(train, eval)`` prompt sets from ``data.*``; ``eval`` is None when there is none.

    With ``train_files`` the files are read (``eval_files`` optional, capped at ``num_eval`` rows when
    that is positive); otherwise the synthetic ``task`` makes both splits, disjoint.
    """
    options = dict(
        prompt_key=cfg.prompt_key,
        answer_key=cfg.answer_key,
        chat_template=cfg.chat_template,
        system_prompt=cfg.system_prompt,
        max_prompt_tokens=cfg.max_prompt_tokens,
    )
    if cfg.train_files is not None:
        train_rows = read_rows(cfg.train_files, "data.train_files", split="train")
        train = build_prompt_set(
            train_rows.rows, tokenizer, source=_describe(cfg.train_files), key="data.train_files",
            where=train_rows.where, **options,
        )  # fmt: skip
        if cfg.eval_files is None:
            return train, None
        eval_rows = read_rows(cfg.eval_files, "data.eval_files", split="eval")
        rows = eval_rows.rows[: cfg.num_eval] if cfg.num_eval > 0 else eval_rows.rows
        held_out = build_prompt_set(
            rows, tokenizer, source=_describe(cfg.eval_files), key="data.eval_files", where=eval_rows.where, **options
        )
        return train, held_out
    if cfg.task is None:
        raise ValueError("data: set data.task (a built-in synthetic task) or data.train_files")
    train_rows, eval_rows = make_task(cfg.task, cfg.num_train, cfg.num_eval, cfg.seed, **dict(cfg.task_args))
    if not train_rows:
        raise ValueError(f"data.num_train: task {cfg.task!r} needs at least one training prompt")
    source = f"task:{cfg.task}"
    train = build_prompt_set(train_rows, tokenizer, source=source, key="data.task", **options)
    if not eval_rows:
        return train, None
    held_out = build_prompt_set(
        eval_rows, tokenizer, source=f"{source} (held out)", key="data.task", **options
    )
    return train, held_out


# --------------------------------------------------------------------------------------------------
# sampling
# --------------------------------------------------------------------------------------------------


class PromptSampler:
    """Endless per-step prompt batches for one rank, resumable exactly.

    The global order is epoch 0's permutation, then epoch 1's, and so on (identity order when
    ``shuffle`` is false); a step takes the next ``prompts_per_step`` prompts of it, crossing into the
    next epoch when the current one runs out, and this rank keeps slice ``rank`` of ``world_size``
    equal slices. ``state_dict()`` is ``{epoch, position, num_items}``.
    """

    def __init__(
        self,
        items: Sequence[PromptItem],
        prompts_per_step: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        if not items:
            raise ValueError("PromptSampler: no prompts to sample from")
        if prompts_per_step <= 0 or prompts_per_step % world_size:
            raise ValueError(
                f"rollout.prompts_per_step={prompts_per_step} must be a positive multiple of the world "
                f"size {world_size} so that every rank gets the same number of prompts"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"PromptSampler: rank {rank} is outside world size {world_size}")
        self.items = list(items)
        self.prompts_per_step = prompts_per_step
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.items)))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.items)).tolist()

    def _next_global_indices(self) -> list[int]:
        indices: list[int] = []
        while len(indices) < self.prompts_per_step:
            if self.position == len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
            take = min(self.prompts_per_step - len(indices), len(self._order) - self.position)
            indices.extend(self._order[self.position : self.position + take])
            self.position += take
        return indices

    def __iter__(self) -> PromptSampler:
        return self

    def __next__(self) -> list[PromptItem]:
        """This rank's prompts for the next step."""
        per_rank = self.prompts_per_step // self.world_size
        global_indices = self._next_global_indices()
        mine = global_indices[self.rank * per_rank : (self.rank + 1) * per_rank]
        return [self.items[i] for i in mine]

    def state_dict(self) -> dict[str, int]:
        """Where the stream stands: the epoch, the position inside it, and the number of prompts."""
        return {"epoch": self.epoch, "position": self.position, "num_items": len(self.items)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a :meth:`state_dict`; the prompt set must be the one it was taken from."""
        if int(state["num_items"]) != len(self.items):
            raise ValueError(
                f"cannot resume the prompt sampler: the checkpoint was taken with {state['num_items']} "
                f"prompts but {len(self.items)} are loaded now (did data.* change?)"
            )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = self._epoch_order(self.epoch)
