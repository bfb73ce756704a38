"""Speculative decoding on SGLang 0.5.23: the server arguments a draft becomes, the weight-sync
selectors, and the acceptance SGLang reports per request (``shared/notes/spec-decoding.md`` §3).

* **Arguments.** ``DraftSpec.method`` picks SGLang's algorithm: ``model`` -> ``STANDALONE`` (a small LM
  with its own embedding and output layer, ``speculative_draft_model_path``), ``eagle`` -> ``EAGLE``
  (a head on the target's hidden states, sharing its embedding and output layer), ``ngram`` ->
  ``NGRAM`` (no weights). A chain of ``k`` proposals is ``speculative_num_steps = k``,
  ``speculative_eagle_topk = 1``, ``speculative_num_draft_tokens = k + 1`` (for NGRAM a BFS breadth of
  1). The accept thresholds stay at SGLang's default 1.0: lower is lossy.
* **Weights.** With a draft worker (STANDALONE, EAGLE), SGLang's default selector ``"all"`` would load
  the policy's tensors into the draft as well; the policy goes with ``selector="target"``, a trained
  draft's tensors (``draft.`` names, prefix removed) in a second session with ``selector="draft"``,
  and the weight version is set once both are in. A draft that does not train is loaded from its
  folder at start (``speculative_draft_load_format="auto"``, whatever the target's dummy format) and
  kept across memory release by ``enable_draft_weights_cpu_backup``.
* **Acceptance.** Per request, ``meta_info`` has ``spec_verify_ct`` (target forwards),
  ``spec_num_correct_drafts`` and ``spec_num_proposed_drafts`` (older releases:
  ``spec_accept_token_num`` / ``spec_draft_token_num``) and ``completion_tokens``. The no-draft
  estimate assumes a verification costs what a decode step costs (decoding is memory-bound on a
  GPU): generation time x completion tokens / target forwards.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from rlite.api import DRAFT_PREFIX, DraftSpec, EngineError, SpeculationStats

ALGORITHMS = {"model": "STANDALONE", "eagle": "EAGLE", "ngram": "NGRAM"}
"""``DraftSpec.method`` -> SGLang's ``speculative_algorithm``."""


def has_draft_weights(draft: DraftSpec | None) -> bool:
    """The draft runs on a draft worker with weights of its own (STANDALONE, EAGLE)."""
    return draft is not None and draft.method in ("model", "eagle")


def speculative_server_args(draft: DraftSpec) -> dict[str, Any]:
    """SGLang ``ServerArgs`` for ``draft`` (the draft's own ``engine_args`` override them)."""
    k = draft.num_speculative_tokens
    args: dict[str, Any] = {
        "speculative_algorithm": ALGORITHMS[draft.method],
        "speculative_num_draft_tokens": k + 1,
    }
    if draft.method == "ngram":
        args.update(
            speculative_num_steps=k,
            speculative_ngram_min_bfs_breadth=1,
            speculative_ngram_max_bfs_breadth=1,  # a chain, as in the transformers engine
        )
    else:
        args.update(
            speculative_draft_model_path=draft.model_path,
            speculative_num_steps=k,
            speculative_eagle_topk=1,
        )
        if not draft.trained:  # weights from the folder, kept over a memory release
            args.update(speculative_draft_load_format="auto", enable_draft_weights_cpu_backup=True)
    args.update(dict(draft.engine_args))
    return args


def split_draft_stream(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, Iterator[tuple[str, torch.Tensor]]]]:
    """``(selector, tensors)`` for each run of the sync stream: the policy's (``"target"``), then a
    trained draft's (``"draft"``, names without ``draft.``). Consume each run before the next."""
    for is_draft, run in itertools.groupby(named_tensors, key=lambda item: item[0].startswith(DRAFT_PREFIX)):
        if is_draft:
            yield "draft", ((name[len(DRAFT_PREFIX) :], tensor) for name, tensor in run)
        else:
            yield "target", run


def sync_policy_and_draft(
    engine: Any, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, draft: DraftSpec | None, **common
) -> None:
    """:func:`~rlite.plugins.sglang.payloads.sync_weights` for an engine that may run a draft worker: the
    policy with ``selector="target"`` (checked against SGLang's checksums when ``common`` has a
    ``tensor_hash``), a trained draft's tensors with ``selector="draft"``, then the version once. Without
    a draft worker, one session to SGLang's default selector. ``engine`` is None on a group's members."""
    from rlite.plugins.sglang.payloads import set_weight_version, sync_weights

    if not has_draft_weights(draft):
        sync_weights(engine, named_tensors, version, **common)
        return
    unchecked = {**common, "tensor_hash": None}
    for selector, tensors in split_draft_stream(named_tensors):
        sync_weights(engine, tensors, version, selector=selector, set_version=False,
                     **(common if selector == "target" else unchecked))  # fmt: skip
    set_weight_version(engine, version, common.get("group"))


def _first(meta: dict[str, Any], *keys: str) -> Any:
    for key in keys:
        if meta.get(key) is not None:
            return meta[key]
    return None


def speculation_from_outputs(
    outputs: list[dict[str, Any]], draft: DraftSpec, time_s: float
) -> SpeculationStats:
    """The :class:`SpeculationStats` of one generate call from its outputs' ``meta_info``."""
    stats = SpeculationStats(time_s=time_s)
    for output in outputs:
        meta = output.get("meta_info", {})
        verify = int(meta.get("spec_verify_ct") or 0)
        tokens = int(_first(meta, "completion_tokens") or len(meta.get("output_token_logprobs") or ()))
        if verify <= 0:  # nothing was speculated for this request (or SGLang reported nothing)
            verify = tokens
        accepted = _first(meta, "spec_num_correct_drafts", "spec_accepted_drafts", "spec_accept_token_num")
        proposed = _first(meta, "spec_num_proposed_drafts", "spec_proposed_drafts", "spec_draft_token_num")
        stats.verifications += verify
        stats.emitted += tokens
        stats.accepted += int(accepted) if accepted is not None else max(tokens - verify, 0)
        stats.proposed += int(proposed) if proposed is not None else verify * draft.num_speculative_tokens
    if stats.verifications:
        stats.no_draft_estimate_s = time_s * stats.emitted / stats.verifications
    return stats


def top_logprobs_from_output(output: dict[str, Any], k: int) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, logprobs)`` ``[tokens, k]`` from ``meta_info["output_top_logprobs"]`` (per generated token,
    ``(logprob, token_id, text)`` entries, most likely first), as ``Completion.top_ids/top_logprobs``."""
    rows = output.get("meta_info", {}).get("output_top_logprobs")
    if rows is None:
        raise EngineError("SGLang output has no output_top_logprobs (was top_logprobs_num set?)")
    ids = np.zeros((len(rows), k), dtype=np.int64)
    logprobs = np.full((len(rows), k), -1e30, dtype=np.float32)  # finite: a softmax over them stays a number
    for t, entries in enumerate(rows):
        for j, entry in enumerate(list(entries or ())[:k]):
            logprobs[t, j], ids[t, j] = float(entry[0]), int(entry[1])
    return ids, logprobs
