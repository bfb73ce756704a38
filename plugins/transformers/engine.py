"""Rollout engine on transformers ``generate`` with a KV cache (CPU, or any device torch runs on).

Log-probs of sampled tokens are ``log_softmax(logits / temperature)`` of the raw logits, the same
formula the trainer uses (top-k/top-p only restrict which tokens can be drawn). Sampling is seeded
per call, so a resumed run samples exactly what an uninterrupted one would.

``true_on_policy=True`` replaces ``generate`` by a sampler that calls the model's plain forward on a
fixed ``[B, P + T]`` buffer each step (no KV cache). The trainer scores the same buffer layout, so the
rollout log-probs equal the trainer's bit for bit (``../docs/mismatch.md``). It costs T full forwards.

With a speculative draft (``draft=DraftSpec(...)``) every sample goes through
:mod:`rlite.plugins.transformers.speculative` instead: the same distribution and log-probs, fewer
forwards of the policy (``../docs/speculative.md``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from pathlib import Path

import torch

from rlite.api import (
    DRAFT_PREFIX,
    Completion,
    DraftSpec,
    EngineCapabilities,
    EngineError,
    RouterHooks,
    SamplingParams,
    SpeculationStats,
    cache_kwarg,
    filter_logits,
    left_pad,
    position_ids_from_mask,
    sample_categorical,
)
from rlite.plugins.transformers.decode import (
    DECODE_MODES,
    decode_cache,
    decode_graph,
    decode_static,
    prefill_inputs,
)


def _can_share(target: torch.Tensor, tensor: torch.Tensor, *, meta: bool = False,
               device: torch.device | None = None) -> bool:
    """Whether the engine's ``target`` can be bound to ``tensor`` (same shape, dtype and device; a
    ``meta`` target, which has no device yet, is compared with the engine's ``device``)."""
    where = device if meta else target.device
    return (
        target.shape == tensor.shape
        and target.dtype == tensor.dtype
        and torch.device(where) == tensor.device
        and not tensor.requires_grad
    )


class TransformersEngine:
    """A colocated rollout engine around a transformers causal LM."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        pad_token_id: int,
        eos_token_ids: Iterable[int],
        true_on_policy: bool = False,
        share_prefill: bool = True,
        decode: str = "loop",
        share_weights: bool = False,
        draft: DraftSpec | None = None,
        draft_model: torch.nn.Module | None = None,
        auto_decode: bool = False,
    ) -> None:
        """``share_weights=True``: a sync binds the engine's parameters to the tensors it is given
        instead of copying them, when shape, dtype and device match. Given the trainer's own
        parameter storage (world size 1, in the same process), the engine keeps no second copy of the
        model and a sync moves no bytes; the trainer must not change its weights between a sync and
        the generation that follows (rlite's loop never does).

        ``draft``: decode speculatively with this draft (``model`` drafts run ``draft_model``, a causal
        LM with the policy's vocabulary; a trained one's weights come with every sync under
        ``draft.`` names).

        ``decode``: ``loop`` (a KV cache that finished rows leave: the CPU's fastest), ``generate``
        (transformers' own), ``static`` (every row kept, no host synchronisation per token) or ``graph``
        (``static`` with each token's step replayed from a CUDA graph: a GPU's fastest), see
        :mod:`rlite.plugins.transformers.decode`. ``auto_decode``: ``decode`` was chosen for the
        engine, not by the user: a call that records MoE routing decodes with the loop, and a model whose
        step cannot be captured as a graph decodes ``static`` (said once), instead of failing."""
        if decode not in DECODE_MODES:
            raise ValueError(f"decode must be one of {', '.join(DECODE_MODES)}, got {decode!r}")
        self.model = model.eval()
        self.share_prefill = share_prefill
        self.decode = decode
        self.auto_decode = auto_decode
        self.graph_failure: str | None = None
        """Why the graph path could not capture this model's step (it then decodes ``static``)."""
        self.pad_token_id = int(pad_token_id)
        self.eos_token_ids = sorted({int(t) for t in eos_token_ids})
        self.true_on_policy = true_on_policy
        self.weight_version = 0
        self.share_weights = share_weights
        self.routers = RouterHooks.attach(self.model)
        """Hooks on the routers of an MoE model (``None`` for a dense one): record the routing."""
        self.capabilities = EngineCapabilities(
            shares_weights=share_weights, routed_experts=True, draft_methods=SPECULATIVE_METHODS
        )
        self.draft, self.draft_model, self.speculator = draft, draft_model, None
        if draft is not None:
            self.speculator = build_speculator(self.model, draft, draft_model, self.pad_token_id)
        self._speculation = SpeculationStats()
        self._grid: torch.Tensor | None = None
        self.shared_bytes = 0
        """Bytes of the engine's weights that are the sync's tensors themselves (``share_weights``)."""
        tensors = [*self.model.parameters(), *self.model.buffers()]
        self.device = next((t.device for t in tensors if not t.is_meta), torch.device("cpu"))
        """Where parameters built on the meta device get their storage (the model's buffers' device)."""
        for p in self.synced_parameters().values():
            p.requires_grad_(False)
        self._check_decode()

    def _check_decode(self) -> None:
        """Refuse a fixed-shape decode the engine's other settings leave no room for."""
        if self.decode not in ("static", "graph"):
            return
        why = None
        if self.true_on_policy:
            why = "true on-policy mode samples with the trainer's own fixed-shape forward (no KV cache)"
        elif self.speculator is not None:
            why = "a speculative draft decodes through its own verification steps"
        elif self.decode == "graph" and self.device.type != "cuda":
            why = f"CUDA graphs need a CUDA device; the engine's model is on {self.device}"
        elif self.decode == "graph":
            from rlite.plugins.transformers.decode import graph_decode_refusal

            why = graph_decode_refusal(self.model)
        if why is not None:
            raise EngineError(f"decode={self.decode!r}: {why}; use decode='loop' (or 'auto')")

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, *, dtype: torch.dtype = torch.float32, **kwargs):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=dtype, attn_implementation=kwargs.pop("attn_implementation", "sdpa")
        )
        return cls(model, **kwargs)

    # -- generation ---------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        if not prompts:
            return []
        unsynced = [name for name, p in self.synced_parameters().items() if p.is_meta]
        if unsynced:
            raise EngineError(
                f"the engine's model was built without weights ({unsynced[0]!r} and {len(unsynced) - 1} more have "
                "none yet): a complete weight sync must come before the first generate"
            )
        expanded = [p for p in prompts for _ in range(params.n)]  # groups stay contiguous
        device = next(self.model.parameters()).device  # the engine runs where its model lives
        ids, mask = (t.to(device) for t in left_pad(expanded, self.pad_token_id))
        stop_ids = sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids)))
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**31 - 1, ()).item())
        record = params.return_routed_experts and self.routers is not None
        if record and self.decode == "generate" and not self.true_on_policy:
            raise EngineError("return_routed_experts: the transformers engine records routing with decode='loop' only")
        if self.speculator is not None:
            if record:
                raise EngineError("return_routed_experts: not recorded under speculative decoding (rollout.draft)")
            return self._generate_speculatively(prompts, params, stop_ids, seed)
        if params.top_logprobs:
            raise EngineError("top_logprobs: the transformers engine reports them with a speculative draft only")
        self._grid = None
        if record:  # [B, P + T, L, K] on the batch's grid, -1 where nothing ran
            shape = self.routers.shape
            self._grid = torch.full(
                (len(expanded), ids.shape[1] + params.max_new_tokens, shape.num_layers, shape.top_k), -1, dtype=torch.int32
            )
        decode = self.decode
        if record and decode in ("static", "graph") and not self.true_on_policy:
            if not self.auto_decode:
                raise EngineError(f"return_routed_experts: recorded with decode='loop' only, not {decode!r}")
            decode = "loop"
        if decode == "graph" and self.graph_failure is not None:
            decode = "static"
        with seeded(seed, device), self.routers.recording() if record else contextlib.nullcontext():
            if self.true_on_policy:
                tokens, logprobs = self._sample_fixed_shape(ids, mask, params, stop_ids)
            elif decode == "loop":
                tokens, logprobs = self._sample_loop(prompts, ids, mask, params, stop_ids)
            elif decode == "static":
                tokens, logprobs = decode_static(self, prompts, ids, mask, params, stop_ids)
            elif decode == "graph":
                tokens, logprobs = decode_graph(self, prompts, ids, mask, params, stop_ids, capture=True,
                                                on_failure=self._graph_failed)
            else:
                cache = self._prefill_once_per_prompt(prompts, params.n) if self.share_prefill else None
                tokens, logprobs = self._sample_generate(ids, mask, params, stop_ids, cache)
        completions = self._to_completions(tokens.cpu(), logprobs.cpu(), params, stop_ids)
        if record:
            width = ids.shape[1]
            for row, completion in enumerate(completions):
                start = width - len(expanded[row])
                end = width + len(completion.token_ids) - 1
                completion.routed_experts = self._grid[row, start:max(end, start)].numpy().copy()
            self._grid = None
        return completions

    def _graph_failed(self, reason: str) -> None:
        """A capture of the decode step failed: refuse (``decode='graph'`` asked for) or decode without
        the graph from now on, saying so once."""
        message = (f"the transformers engine could not capture its decode step as a CUDA graph ({reason}); "
                   "it decodes without one (decode='static'), correctly but slower")
        if not self.auto_decode:
            raise EngineError(f"decode='graph': {message.split('; ')[0]}; set rollout.engine.args.decode=static")
        import warnings

        warnings.warn(message, RuntimeWarning, stacklevel=2)
        self.graph_failure = reason

    def _generate_speculatively(self, prompts, params: SamplingParams, stop_ids, seed: int) -> list[Completion]:
        with seeded(seed, self.device):
            out = self.speculator.sample(prompts, params, stop_ids, fixed_shape=self.true_on_policy)
        self._speculation = out.stats
        completions = self._to_completions(out.tokens.cpu(), out.logprobs.cpu(), params, stop_ids)
        if out.top_ids is not None:
            for row, completion in enumerate(completions):
                length = len(completion.token_ids)
                completion.top_ids = out.top_ids[row, :length].cpu().numpy()
                completion.top_logprobs = out.top_logprobs[row, :length].cpu().numpy()
        return completions

    def speculation_stats(self) -> SpeculationStats:
        """What the draft did in the last ``generate`` (all zeros without a draft)."""
        return self._speculation

    def _record_routing(self, rows: torch.Tensor | slice, columns: slice, num_rows: int) -> None:
        """After a forward of ``num_rows`` rows over ``columns`` of the grid: store its routing."""
        if self._grid is None:
            return
        width = columns.stop - columns.start
        taken = self.routers.take(num_rows * width).view(num_rows, width, *self._grid.shape[2:])
        self._grid[rows, columns] = taken

    def _prefill_once_per_prompt(self, prompts: list[list[int]], n: int, reserve: int | None = None):
        """KV cache of every prompt but its last token, computed once and repeated for the n samples
        (``generate`` then feeds only the last prompt token). None when there is nothing to share.
        ``reserve``: room for that many more tokens per row (the lean loop's cache); None gives
        transformers' own ``DynamicCache`` (for ``generate``)."""
        from transformers import DynamicCache

        device = next(self.model.parameters()).device
        unique_ids, unique_mask = (t.to(device) for t in left_pad(prompts, self.pad_token_id))
        if n == 1 or unique_ids.shape[1] < 2:
            return None
        if reserve is None:
            cache = DynamicCache(config=self.model.config)
        else:
            cache = decode_cache(self.model.config, reserve)
        self.model(
            input_ids=unique_ids[:, :-1],
            attention_mask=unique_mask[:, :-1],
            position_ids=position_ids_from_mask(unique_mask)[:, :-1],
            use_cache=True,
            **{cache_kwarg(self.model): cache},
        )
        if self._grid is not None:  # the prompts' routing, once per prompt, to each of its n rows
            columns = unique_ids.shape[1] - 1
            taken = self.routers.take(len(prompts) * columns).view(len(prompts), columns, *self._grid.shape[2:])
            self._grid[:, :columns] = taken.repeat_interleave(n, dim=0)
        cache.batch_repeat_interleave(n)
        return cache

    def _sample_generate(self, ids, mask, params: SamplingParams, stop_ids, cache=None):
        out = self.model.generate(
            **{cache_kwarg(self.model): cache},
            input_ids=ids,
            attention_mask=mask,
            do_sample=not params.greedy,
            temperature=params.temperature if not params.greedy else None,
            top_k=params.top_k if (params.top_k and not params.greedy) else None,
            top_p=params.top_p if (params.top_p < 1.0 and not params.greedy) else None,
            max_new_tokens=params.max_new_tokens,
            min_new_tokens=0,
            eos_token_id=stop_ids or None,
            pad_token_id=self.pad_token_id,
            output_logits=True,
            return_dict_in_generate=True,
            use_cache=True,
        )
        tokens = out.sequences[:, ids.shape[1] :]
        logits = torch.stack(out.logits, dim=1).float()  # raw logits, [B, T, V]
        logprobs = torch.log_softmax(logits / params.temperature, dim=-1)
        logprobs = logprobs.gather(-1, tokens[..., None]).squeeze(-1)
        return tokens, logprobs

    def _sample_loop(self, prompts, ids, mask, params: SamplingParams, stop_ids):
        """A lean KV-cache decode loop: one forward of the last token per step, no ``generate``
        machinery, and finished rows leave the batch (and the cache) as soon as they stop."""
        batch, _ = ids.shape
        cache, step_ids, step_positions, positions = prefill_inputs(self, prompts, ids, mask, params)
        first_column = ids.shape[1] - step_ids.shape[1]  # grid column of the step's first token
        device = ids.device
        tokens = torch.full((batch, params.max_new_tokens), self.pad_token_id, dtype=torch.long, device=device)
        logprobs = torch.zeros(batch, params.max_new_tokens, device=device)
        rows = torch.arange(batch, device=device)  # the rows still generating
        attention = mask
        stop = torch.tensor(stop_ids, dtype=torch.long, device=device)
        next_position = positions[:, -1] + 1
        for t in range(params.max_new_tokens):
            logits = self.model(
                input_ids=step_ids,
                attention_mask=attention,
                position_ids=step_positions,
                use_cache=True,
                logits_to_keep=1,
                **{cache_kwarg(self.model): cache},
            ).logits[:, -1].float() / params.temperature
            self._record_routing(rows.cpu(), slice(first_column, first_column + step_ids.shape[1]), len(rows))
            first_column += step_ids.shape[1]
            if params.greedy:
                chosen = logits.argmax(-1)
            else:
                chosen = sample_categorical(filter_logits(logits, params.top_k, params.top_p).softmax(-1))
            tokens[rows, t] = chosen
            logprobs[rows, t] = torch.log_softmax(logits, dim=-1).gather(-1, chosen[:, None]).squeeze(1)
            going = ~torch.isin(chosen, stop) if len(stop_ids) else torch.ones_like(chosen, dtype=torch.bool)
            if not bool(going.any()):
                break
            if not bool(going.all()):
                keep = going.nonzero().squeeze(1)
                cache.batch_select_indices(keep)
                rows, chosen, attention, next_position = rows[keep], chosen[keep], attention[keep], next_position[keep]
            attention = torch.cat([attention, attention.new_ones(len(rows), 1)], dim=1)
            step_ids, step_positions = chosen[:, None], next_position[:, None]
            next_position = next_position + 1
        return tokens, logprobs

    def _sample_fixed_shape(self, ids, mask, params: SamplingParams, stop_ids):
        """Sample with full forwards over a fixed [B, P+T] buffer (bitwise equal to the trainer)."""
        batch, prompt_len = ids.shape
        total = prompt_len + params.max_new_tokens
        device = ids.device
        buffer = torch.full((batch, total), self.pad_token_id, dtype=torch.long, device=device)
        buffer[:, :prompt_len] = ids
        full_mask = torch.cat([mask, mask.new_ones(batch, params.max_new_tokens)], dim=1)
        positions = position_ids_from_mask(full_mask)
        logprobs = torch.zeros(batch, params.max_new_tokens, device=device)
        done = torch.zeros(batch, dtype=torch.bool, device=device)
        stop = torch.tensor(stop_ids, dtype=torch.long, device=device)
        for t in range(params.max_new_tokens):
            logits = self.model(input_ids=buffer, attention_mask=full_mask, position_ids=positions).logits
            self._record_routing(slice(None), slice(0, total), batch)  # the last forward's holds every token
            step_logits = logits[:, prompt_len - 1 + t].float() / params.temperature
            step_logprobs = torch.log_softmax(step_logits, dim=-1)
            if params.greedy:
                nxt = step_logits.argmax(-1)
            else:
                probs = filter_logits(step_logits, params.top_k, params.top_p).softmax(-1)
                nxt = sample_categorical(probs)
            nxt = torch.where(done, torch.full_like(nxt, self.pad_token_id), nxt)
            buffer[:, prompt_len + t] = nxt
            logprobs[:, t] = step_logprobs.gather(-1, nxt[:, None]).squeeze(1)
            if stop_ids:
                done |= torch.isin(nxt, stop)
            if bool(done.all()):
                break
        return buffer[:, prompt_len:], logprobs

    def _to_completions(self, tokens, logprobs, params: SamplingParams, stop_ids) -> list[Completion]:
        completions = []
        stop_set = set(stop_ids)
        for row in range(tokens.shape[0]):
            row_tokens = tokens[row].tolist()
            length, reason = len(row_tokens), "length"
            for pos, tok in enumerate(row_tokens):
                if tok in stop_set:
                    length, reason = pos + 1, "stop"
                    break
            completions.append(
                Completion(
                    prompt_index=row // params.n,
                    token_ids=row_tokens[:length],
                    logprobs=logprobs[row, :length].tolist(),
                    finish_reason=reason,
                    weight_version=self.weight_version,
                )
            )
        return completions

    # -- weights ------------------------------------------------------------------------------
    @torch.no_grad()
    def update_weights(self, named_tensors, version: int, *, complete: bool = True) -> None:
        """Copy tensors (Hugging Face names) into the model and switch to ``version``.

        With ``complete=True`` every parameter of the engine model must be among the tensors: a sync
        that silently leaves some weights stale (a LoRA run syncing only the base, a renamed module)
        is an error, not a warning.
        """
        params = self.synced_parameters()
        seen = set()
        shared = 0
        for name, tensor in named_tensors or []:
            if name not in params:
                if is_tied_output_layer(name):  # tied weights appear under one name only in named_parameters()
                    continue
                raise EngineError(f"weight sync: engine model has no parameter named {name!r}")
            target = params[name]
            if target.shape != tensor.shape:
                raise EngineError(
                    f"weight sync: {name} has shape {tuple(tensor.shape)}, engine expects {tuple(target.shape)}"
                )
            if target.is_meta:  # built without weights (skeleton_causal_lm): the first sync gives the storage
                bind = self.share_weights and _can_share(target, tensor, meta=True, device=self.device)
                target = params[name] = give_storage([self.model, self.draft_model], target, self.device,
                                                     storage=tensor.detach() if bind else None)
            if self.share_weights and _can_share(target, tensor):
                if target.data_ptr() != tensor.data_ptr() or target.stride() != tensor.stride():
                    target.data = tensor.detach()  # bound once; later syncs find the same storage
                shared += tensor.numel() * tensor.element_size()
            else:
                target.copy_(tensor)
            seen.add(name)
        if complete:
            missing = sorted(set(params) - seen)
            if missing:
                raise EngineError(
                    f"weight sync v{version} left {len(missing)} engine parameters stale, e.g. {missing[:3]}"
                )
        self.shared_bytes = shared
        self.weight_version = int(version)

    def named_weights(self):
        return list(self.model.named_parameters())

    def synced_parameters(self) -> dict[str, torch.nn.Parameter]:
        """What a weight sync writes, by name: the policy's parameters, then a trained draft's under
        ``draft.`` names (a draft loaded from its folder is not synced)."""
        params = dict(self.model.named_parameters())
        if self.draft_model is not None and self.draft is not None and self.draft.trained:
            params.update((DRAFT_PREFIX + name, p) for name, p in self.draft_model.named_parameters())
        return params

    def release_memory(self) -> None:
        """Nothing to free on CPU; the KV cache lives only inside ``generate``."""

    def resume_memory(self) -> None:
        """See :meth:`release_memory`."""

    def shutdown(self) -> None:
        self.model = self.draft_model = self.speculator = None


@contextlib.contextmanager
def seeded(seed: int, device: torch.device):
    """Seed torch's generators inside, and restore the caller's states after: the CPU's, and the
    engine's GPU's when it runs on one (``manual_seed`` seeds every device, and the trainer beside the
    engine on that GPU must not see its generator reseeded by a rollout)."""
    devices = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def give_storage(models: list[torch.nn.Module | None], param: torch.nn.Parameter,
                 device: torch.device, storage: torch.Tensor | None = None) -> torch.nn.Parameter:
    """Replace a meta-device parameter, in every module of ``models`` that holds it (tied weights are
    one parameter in two modules), by one with (uninitialised) storage on ``device``, or bound to
    ``storage`` (a tensor of its shape and dtype, shared, not copied); return it."""
    data = torch.empty_like(param, device=device) if storage is None else storage
    fresh = torch.nn.Parameter(data, requires_grad=param.requires_grad)
    for model in models:
        for module in [] if model is None else model.modules():
            for key, value in module._parameters.items():
                if value is param:
                    module._parameters[key] = fresh
    return fresh


def is_tied_output_layer(name: str) -> bool:
    """The output layer of the policy or of a trained draft, which ``named_parameters()`` does not list
    when it is tied to the input embedding (a sync may still send it)."""
    return name in ("lm_head.weight", DRAFT_PREFIX + "lm_head.weight")


def load_draft_model(draft: DraftSpec | None, attn_implementation: str = "sdpa",
                     weights_from_sync: bool = False, device: torch.device | None = None) -> torch.nn.Module | None:
    """The causal LM of a ``model`` draft, from its folder, on ``device`` (default: the host); ``None``
    for drafts without weights. ``weights_from_sync``: a trained draft is built without reading its
    weights (parameters on the meta device), since the engine's first sync sends them."""
    if draft is None or draft.method != "model":
        return None
    if weights_from_sync and draft.trained:
        from rlite.api import skeleton_causal_lm

        return skeleton_causal_lm(draft.model_path, draft.dtype, attn_implementation, device=device)
    from transformers import AutoModelForCausalLM

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[draft.dtype]
    model = AutoModelForCausalLM.from_pretrained(draft.model_path, dtype=dtype, attn_implementation=attn_implementation)
    return model if device is None else model.to(device)


SPECULATIVE_METHODS = ("model", "ngram")
"""The drafts the transformers engine runs (``DraftSpec.method``)."""


def build_speculator(model: torch.nn.Module, draft: DraftSpec, draft_model: torch.nn.Module | None, pad_token_id: int):
    """The speculative decoder of an engine: its draft's proposer and the policy that verifies."""
    from rlite.plugins.transformers.speculative import SpeculativeDecoder, build_proposer

    if draft.method not in SPECULATIVE_METHODS:
        raise EngineError(
            f"the transformers engine cannot run a {draft.method!r} draft; it runs {', '.join(SPECULATIVE_METHODS)}"
        )
    attn = getattr(model.config, "_attn_implementation", "sdpa")
    if attn not in ("sdpa", "eager"):
        raise EngineError(f"speculative decoding needs attn_implementation sdpa or eager (its masks are 4-D), not {attn}")
    if draft.method == "model":
        if draft_model is None:
            raise EngineError("a 'model' draft needs its draft_model")
        policy_vocab, draft_vocab = model.get_output_embeddings().weight.shape[0], draft_model.get_output_embeddings().weight.shape[0]
        if policy_vocab != draft_vocab:
            raise EngineError(f"the draft's vocabulary has {draft_vocab} tokens, the policy's {policy_vocab}")
        draft_model.eval().requires_grad_(False)
    return SpeculativeDecoder(model, draft, build_proposer(draft, draft_model, pad_token_id), pad_token_id)
