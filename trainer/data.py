"""Prompts: loading them (a synthetic task or files), tokenising them, and handing them out per step.

:func:`load_prompt_splits` turns ``data.*`` into a training :class:`PromptSet` and an optional held-out
one. Files (.jsonl/.json, .parquet, or a folder written by ``datasets.Dataset.save_to_disk``) are read
with the ``datasets`` library, in memory and with a throw-away cache folder so that nothing piles up
under ``HF_HOME``. Each row's prompt (a string or a list of chat messages) is wrapped with the
tokenizer's chat template when ``data.chat_template`` is true, then tokenised without special tokens;
prompts longer than ``data.max_prompt_tokens`` are dropped and counted.

:class:`PromptSampler` yields each step's prompts for one rank: the global batch of
``prompts_per_step`` prompts is cut into ``world_size`` equal contiguous slices. The prompt order is
an endless stream of epochs, each a permutation drawn from ``(seed, epoch)``; its position is the
whole state, so a resumed run sees exactly the prompts an uninterrupted one would.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Iterator, Sequence
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


def read_rows(path: str | Path, key: str, split: str = "train") -> list[dict[str, Any]]:
    """Read a .jsonl/.json/.parquet file or a ``save_to_disk`` folder into a list of row dicts.

    ``key`` (``data.train_files`` or ``data.eval_files``) names the setting in error messages;
    ``split`` picks the split of a saved ``DatasetDict`` (``"eval"`` tries test, validation, eval).
    """
    import datasets

    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{key}: {str(path)!r} does not exist")
    progress_was_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        if path.is_dir():
            dataset = _load_saved_folder(path, key, split)
        else:
            builder = FILE_LOADERS.get(path.suffix.lower())
            if builder is None:
                raise ValueError(
                    f"{key}: cannot read {str(path)!r}: unsupported extension {path.suffix!r}. Use "
                    f"{', '.join(FILE_LOADERS)} or a folder written by datasets.Dataset.save_to_disk."
                )
            if _is_blank(path):
                raise ValueError(f"{key}: {str(path)!r} holds no rows")
            # keep_in_memory alone still writes an Arrow copy under HF_HOME; a temporary cache folder
            # is removed as soon as the rows are in memory.
            with tempfile.TemporaryDirectory(prefix="rlite-data-") as cache_dir:
                try:
                    dataset = datasets.load_dataset(
                        builder, data_files=str(path), split="train", keep_in_memory=True, cache_dir=cache_dir
                    )
                except Exception as exc:  # datasets raises many kinds; say which setting and file
                    raise ValueError(f"{key}: cannot read {str(path)!r} as {builder}: {exc}") from exc
    finally:
        if progress_was_on:
            datasets.enable_progress_bars()
    rows = dataset.to_list()
    if not rows:
        raise ValueError(f"{key}: {str(path)!r} holds no rows")
    return rows


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
) -> PromptSet:
    """Format and tokenise ``rows`` into a :class:`PromptSet`, dropping over-long prompts.

    ``key`` names the setting the rows came from (for error messages). Each item's row gets the
    prompt under ``"prompt"`` and the answer under ``"answer"`` whatever the source columns are called.
    """
    if not rows:
        raise ValueError(f"{key}: {source} holds no rows")
    columns = list(rows[0])
    for column, setting in ((prompt_key, "data.prompt_key"), (answer_key, "data.answer_key")):
        if column not in columns:
            raise ValueError(
                f"{key}: {source} has no column {column!r} ({setting}). Columns present: {', '.join(columns)}."
            )
    if chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError("data.chat_template is true but the tokenizer has no chat template; set it to false")
    texts = []
    for i, row in enumerate(rows):
        if row.get(answer_key) is None:
            raise ValueError(f"{key}: {source} row {i} has no value in column {answer_key!r}")
        try:
            texts.append(format_prompt(row.get(prompt_key), tokenizer, chat_template, system_prompt))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{key}: {source} row {i}, column {prompt_key!r}: {exc}") from None
    all_ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    items = []
    for i, (row, text, ids) in enumerate(zip(rows, texts, all_ids)):
        if len(ids) > max_prompt_tokens:
            continue
        full_row = dict(row)
        full_row["prompt"] = row[prompt_key]
        full_row["answer"] = row[answer_key]
        items.append(PromptItem(index=i, prompt_ids=list(ids), prompt_text=text, row=full_row))
    dropped = len(rows) - len(items)
    if dropped:
        logger.warning(
            "%s: dropped %d of %d prompts longer than data.max_prompt_tokens=%d",
            source,
            dropped,
            len(rows),
            max_prompt_tokens,
        )
    if not items:
        raise ValueError(
            f"{key}: every prompt of {source} is longer than data.max_prompt_tokens={max_prompt_tokens}"
        )
    logger.info("%s: %d prompts", source, len(items))
    return PromptSet(items=items, source=source, num_dropped=dropped, columns=columns)


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
            train_rows, tokenizer, source=str(cfg.train_files), key="data.train_files", **options
        )
        if cfg.eval_files is None:
            return train, None
        eval_rows = read_rows(cfg.eval_files, "data.eval_files", split="eval")
        if cfg.num_eval > 0:
            eval_rows = eval_rows[: cfg.num_eval]
        held_out = build_prompt_set(
            eval_rows, tokenizer, source=str(cfg.eval_files), key="data.eval_files", **options
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
