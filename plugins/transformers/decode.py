"""Fixed-shape decoding for the transformers engine: ``static`` and ``graph``.

The engine's ``loop`` decode (:meth:`TransformersEngine._sample_loop`) removes finished rows from the
batch and asks the host after every token whether any row stopped: right on a CPU, where a row less is
work less, but on a GPU every such question stalls the device, and the Python of a transformers
forward (~27 ms a token for a 24-layer model, measured on an H200) dwarfs the kernels it launches.

Both paths here keep every row of the batch to the end and do their bookkeeping on the device:

* ``static``: the same forwards as the loop (the same KV cache, views of exactly the filled columns,
  the same 2-D attention mask), every row kept, no host synchronisation per token (the host looks at
  the stop flags once every :data:`CHECK_EVERY` tokens). On a CPU its tokens and log-probs equal the
  loop's bit for bit for the same seed (``tests/unit/test_static_decode.py``): this is the reference
  of the bookkeeping the graph path shares.
* ``graph``: the first token as ``static`` does it; then the key/value cache moves into buffers of the
  batch's whole width ``P + T`` (:class:`StaticLayer`, written at a column held in a device tensor),
  every step attends over that width under a boolean mask that opens one column a step, and one step
  is captured as a CUDA graph and replayed for every later token: one launch a token instead of a
  forward's Python. Attention over the whole width is not bitwise the loop's (the kernels sum other
  lengths), so on a GPU it is checked against the loop within float rounding (``tests/gpu``), and on a
  CPU its step runs uncaptured against the loop in the tests.

Random numbers: the loop draws one uniform per live row and token from the global CPU generator, in row
order. Both paths draw the same numbers up front (``B x T`` doubles from the CPU generator, one call:
the generator's stream does not depend on how it is cut) and hand the live rows, in order, the next ones
on the device. So the samples are the loop's, and a GPU samples with the numbers a CPU would.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch

from rlite.api import EngineError, SamplingParams, cache_kwarg, draw_from_cdf, filter_logits

CHECK_EVERY = 16
"""Tokens between two looks of the host at the stop flags (the only host synchronisation of a decode);
an early stop of every row is noticed at most this many tokens late."""

DECODE_MODES = ("loop", "static", "graph", "generate")
"""What ``rollout.engine.args.decode`` may name (besides ``auto``)."""

STATIC_ATTENTION = "rlite_static_decode"
"""The name under which :func:`static_decode_attention` is registered with transformers."""


@functools.cache
def _growing_layer_class():
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        """A ``DynamicLayer`` that writes each step's keys and values into a buffer with room for
        ``reserve`` more tokens, instead of concatenating the whole cache every step (``torch.cat`` of
        every layer's cache was 7% of CPU decoding). ``keys``/``values`` are views of the filled part."""

        def __init__(self, reserve: int) -> None:
            super().__init__()
            self.reserve = int(reserve)
            self._length = 0
            self._key_buffer = self._value_buffer = None

        def _expose(self) -> None:
            self.keys = self._key_buffer[:, :, : self._length]
            self.values = self._value_buffer[:, :, : self._length]

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            end = self._length + key_states.shape[-2]
            buffer = self._key_buffer
            if buffer is None or end > buffer.shape[-2] or buffer.shape[0] != key_states.shape[0]:
                capacity = max(end + self.reserve, 0 if buffer is None else 2 * buffer.shape[-2])
                shape = (key_states.shape[0], key_states.shape[1], capacity)
                # keys and values may differ in width (DeepSeek's MLA: nope + rope dims vs v_head_dim)
                keys = key_states.new_empty((*shape, key_states.shape[-1]))
                values = value_states.new_empty((*shape, value_states.shape[-1]))
                if self._length:
                    keys[:, :, : self._length] = self.keys
                    values[:, :, : self._length] = self.values
                self._key_buffer, self._value_buffer = keys, values
            self._key_buffer[:, :, self._length : end] = key_states
            self._value_buffer[:, :, self._length : end] = value_states
            self._length = end
            self._expose()
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self._length

        def _rows(self, select) -> None:
            if self._key_buffer is not None:
                self._key_buffer, self._value_buffer = select(self._key_buffer), select(self._value_buffer)
                self._expose()

        def batch_select_indices(self, indices) -> None:
            self._rows(lambda t: t[indices])

        def batch_repeat_interleave(self, repeats: int) -> None:
            self._rows(lambda t: t.repeat_interleave(repeats, dim=0))

        def reorder_cache(self, beam_idx) -> None:
            self._rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

        def crop(self, max_length: int) -> None:
            raise NotImplementedError("rlite's decode cache is never cropped")

        def reset(self) -> None:
            self._length = 0
            self._key_buffer = self._value_buffer = None
            super().reset()

    return GrowingLayer


def decode_cache(config, reserve: int):
    """A transformers ``DynamicCache`` whose full-attention layers fill preallocated buffers
    (:func:`_growing_layer_class`); sliding-window and other layer kinds keep their own classes."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=config)
    growing = _growing_layer_class()
    cache.layers = [growing(reserve) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


@dataclass
class DecodeState:
    """The device-side state of a fixed-shape decode of ``B`` rows and ``T`` new tokens."""

    tokens: torch.Tensor
    """``[B, T]`` sampled tokens (``pad`` after a row stopped)."""
    logprobs: torch.Tensor
    """``[B, T]`` float32 log-probs of them (0 after a row stopped)."""
    done: torch.Tensor
    """``[B]`` bool: the row has produced a stop token."""
    step: torch.Tensor
    """``[1]`` long: the index of the token the next step samples."""
    uniforms: torch.Tensor | None
    """``[B * T]`` float64 uniforms handed out to the live rows in order (None when greedy)."""
    used: torch.Tensor
    """``[1]`` long: how many uniforms were handed out."""
    invalid: torch.Tensor
    """``[1]`` bool: a live row's probabilities were NaN, infinite or all zero."""
    stop: torch.Tensor
    """The stop token ids (may be empty)."""
    pad_token_id: int
    params: SamplingParams

    @classmethod
    def start(cls, batch: int, params: SamplingParams, stop_ids: list[int], pad_token_id: int,
              device: torch.device) -> DecodeState:
        """Fresh buffers; the uniforms are drawn now from the CPU generator (seeded by the caller)."""
        steps = params.max_new_tokens
        uniforms = None
        if not params.greedy:
            uniforms = torch.rand(batch * steps, dtype=torch.float64).to(device)
        return cls(
            tokens=torch.full((batch, steps), pad_token_id, dtype=torch.long, device=device),
            logprobs=torch.zeros(batch, steps, device=device),
            done=torch.zeros(batch, dtype=torch.bool, device=device),
            step=torch.zeros(1, dtype=torch.long, device=device),
            uniforms=uniforms,
            used=torch.zeros(1, dtype=torch.long, device=device),
            invalid=torch.zeros(1, dtype=torch.bool, device=device),
            stop=torch.tensor(stop_ids, dtype=torch.long, device=device),
            pad_token_id=int(pad_token_id),
            params=params,
        )

    def advance(self, logits: torch.Tensor) -> torch.Tensor:
        """Sample the step's token of every row from ``logits`` ``[B, V]`` (float32, already divided by
        the temperature), record it for the rows still going, and return the tokens ``[B]`` (the next
        step's inputs). Only device operations: it can be captured in a CUDA graph."""
        params = self.params
        live = ~self.done
        if params.greedy:
            chosen = logits.argmax(-1)
        else:
            probs = filter_logits(logits, params.top_k, params.top_p).softmax(-1)
            order = live.long().cumsum(0) - 1  # a live row's place among the live rows
            index = (self.used + order).clamp_(0, self.uniforms.numel() - 1)
            chosen, valid = draw_from_cdf(probs, self.uniforms[index])
            self.used.add_(live.long().sum())
            self.invalid.logical_or_((live & ~valid).any().view(1))
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, chosen[:, None]).squeeze(1)
        self.tokens.index_copy_(1, self.step, torch.where(live, chosen, self.pad_token_id)[:, None])
        self.logprobs.index_copy_(1, self.step, torch.where(live, logprobs, 0.0)[:, None])
        if self.stop.numel():
            self.done.logical_or_(live & torch.isin(chosen, self.stop))
        self.step.add_(1)
        return chosen

    def finished(self) -> bool:
        """Whether every row has stopped (a host synchronisation)."""
        return bool(self.done.all())

    def outputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        if bool(self.invalid.item()):
            raise EngineError("sampling: the probabilities of a row are NaN, infinite or all zero")
        return self.tokens, self.logprobs


def prefill_inputs(engine, prompts: list[list[int]], ids: torch.Tensor, mask: torch.Tensor, params: SamplingParams):
    """What the first forward of every decode takes: the cache (a :func:`decode_cache` with room for every
    token to come; the prompts' own cache, shared across each group's samples, when the engine shares
    prefills), that forward's input ids and positions (the whole prompt, or its last token when the cache
    holds the rest), and every prompt token's position."""
    from rlite.api import position_ids_from_mask

    positions = position_ids_from_mask(mask)
    reserve = params.max_new_tokens + 1
    cache = engine._prefill_once_per_prompt(prompts, params.n, reserve) if engine.share_prefill else None
    if cache is None:  # the whole prompt goes through the first forward
        return decode_cache(engine.model.config, reserve), ids, positions, positions
    return cache, ids[:, -1:], positions[:, -1:], positions  # the cache holds every prompt token but the last


def prefill_and_first_step(engine, prompts: list[list[int]], ids: torch.Tensor, mask: torch.Tensor,
                           params: SamplingParams, state: DecodeState):
    """The fixed-shape decodes' first step for every row: :func:`prefill_inputs` and the first token.
    Returns the cache, the next step's input ids and positions."""
    cache, step_ids, step_positions, positions = prefill_inputs(engine, prompts, ids, mask, params)
    chosen = state.advance(next_token_logits(engine.model, step_ids, mask, step_positions, cache, params))
    return cache, chosen[:, None], positions[:, -1:] + 1


def next_token_logits(model, step_ids, attention, step_positions, cache, params: SamplingParams) -> torch.Tensor:
    """The float32 logits of each row's next token divided by the temperature, as the loop computes them."""
    return model(
        input_ids=step_ids,
        attention_mask=attention,
        position_ids=step_positions,
        use_cache=True,
        logits_to_keep=1,
        **{cache_kwarg(model): cache},
    ).logits[:, -1].float() / params.temperature


@torch.no_grad()
def decode_static(engine, prompts: list[list[int]], ids: torch.Tensor, mask: torch.Tensor, params: SamplingParams,
                  stop_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, T]`` tokens and log-probs, every row kept to the end, the loop's forwards (see the module)."""
    batch, width = ids.shape
    state = DecodeState.start(batch, params, stop_ids, engine.pad_token_id, ids.device)
    cache, step_ids, step_positions = prefill_and_first_step(engine, prompts, ids, mask, params, state)
    attention = torch.cat([mask, mask.new_ones(batch, params.max_new_tokens)], dim=1)
    for t in range(1, params.max_new_tokens):
        if t % CHECK_EVERY == 0 and state.finished():
            break
        width += 1
        logits = next_token_logits(engine.model, step_ids, attention[:, :width], step_positions, cache, params)
        step_ids, step_positions = state.advance(logits)[:, None], step_positions + 1
    return state.outputs()


# --------------------------------------------------------------------------------------------------
# the graph path: the whole width, one captured step
# --------------------------------------------------------------------------------------------------


@functools.cache
def _static_layer_class():
    from transformers.cache_utils import DynamicLayer

    class StaticLayer(DynamicLayer):
        """A layer of the cache whose keys and values are buffers of the batch's whole width; a step
        writes its token's at the column ``column`` (a device tensor every layer shares) and attends
        over the whole buffer (the mask hides what is not written yet): fixed shapes, no host values."""

        def __init__(self, keys: torch.Tensor, values: torch.Tensor, column: torch.Tensor) -> None:
            super().__init__()
            self.keys, self.values, self.column = keys, values, column
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            self.keys.index_copy_(2, self.column, key_states)
            self.values.index_copy_(2, self.column, value_states)
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return int(self.keys.shape[-2])  # never asked for: every step names its positions

    return StaticLayer


def static_decode_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                            **kwargs):
    """Attention of one new token per row over a static cache, for the graph path: ``query`` ``[B, H, 1,
    D]``, ``key``/``value`` ``[B, H_kv, L, D]``, ``attention_mask`` bool ``[B, 1, 1, L]``. The query heads
    that share a key/value head go in as that head's rows (no copy of the cache per query head, which
    transformers' ``repeat_kv`` makes). Returns ``[B, 1, H, D]``, as transformers' attention functions do."""
    batch, heads, length, dim = query.shape
    groups = heads // key.shape[1]
    if length != 1:
        raise EngineError(f"static decode attention takes one token per row, got {length}")
    grouped = query.view(batch, key.shape[1], groups, dim)  # head h = kv head (h // groups), row h % groups
    out = torch.nn.functional.scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(batch, heads, 1, dim).transpose(1, 2), None


def graph_decode_refusal(model) -> str | None:
    """Why the graph path cannot decode ``model`` (None: it can). It needs full attention in every layer
    (no sliding windows) and no attention-logit soft-capping."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"}:
        return f"its layers are {sorted(layer_types)}; the graph path decodes full attention only"
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        return "it uses sliding-window attention; the graph path decodes full attention only"
    if getattr(config, "attn_logit_softcapping", None):
        return "it soft-caps attention logits, which the graph path's attention does not"
    return None


@contextlib.contextmanager
def static_attention(model):
    """The model's attention goes through :func:`static_decode_attention` inside (every config object of
    its modules switched, and switched back after)."""
    from transformers import AttentionInterface

    AttentionInterface.register(STATIC_ATTENTION, static_decode_attention)
    configs = {id(m.config): m.config for m in model.modules() if hasattr(getattr(m, "config", None), "_attn_implementation")}
    before = {key: config._attn_implementation for key, config in configs.items()}
    try:
        for config in configs.values():
            config._attn_implementation = STATIC_ATTENTION
        yield
    finally:
        for key, config in configs.items():
            config._attn_implementation = before[key]


class GraphStep:
    """One decode step over the whole width, its inputs and outputs in fixed buffers (so it can be
    captured once and replayed): reads ``ids``/``positions``, writes the cache at ``column``, samples
    through :meth:`DecodeState.advance`, then moves ``ids``, ``positions`` and ``column`` on by one."""

    def __init__(self, model, state: DecodeState, cache, allowed: torch.Tensor, column: torch.Tensor,
                 ids: torch.Tensor, positions: torch.Tensor) -> None:
        self.model, self.state, self.cache = model, state, cache
        self.allowed, self.column, self.ids, self.positions = allowed, column, ids, positions
        self.columns = torch.arange(allowed.shape[1], device=allowed.device)
        self.graph = None

    def __call__(self) -> None:
        mask = (self.allowed & (self.columns <= self.column))[:, None, None, :]
        logits = next_token_logits(self.model, self.ids, {"full_attention": mask}, self.positions, self.cache,
                                   self.state.params)
        self.ids.copy_(self.state.advance(logits)[:, None])
        self.positions.add_(1)
        self.column.add_(1)

    def capture(self) -> None:
        """Record one step as a CUDA graph (nothing runs); :meth:`replay` runs it."""
        graph = torch.cuda.CUDAGraph()
        # thread_local: with rollout.mode=one_step_off the engine captures on the rollout thread while the
        # trainer's thread works on the same GPU; only this thread's calls must be capture-safe
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self()
        self.graph = graph

    def replay(self) -> None:
        self.graph.replay()


def whole_width_cache(model, growing_cache, batch: int, width: int, filled: int, device: torch.device):
    """A cache of :class:`StaticLayer` s of ``width`` columns holding the first ``filled`` columns of the
    growing cache the first step left (which it then frees), and the device column they share."""
    from transformers import DynamicCache

    column = torch.full((1,), filled, dtype=torch.long, device=device)
    layers = []
    static_layer = _static_layer_class()
    for layer in growing_cache.layers:
        keys, values = layer.keys, layer.values
        k = keys.new_zeros(batch, keys.shape[1], width, keys.shape[-1])
        v = values.new_zeros(batch, values.shape[1], width, values.shape[-1])
        k[:, :, :filled] = keys[:, :, :filled]
        v[:, :, :filled] = values[:, :, :filled]
        layers.append(static_layer(k, v, column))
    growing_cache.layers = []
    cache = DynamicCache(config=model.config)
    cache.layers = layers
    return cache, column


@torch.no_grad()
def decode_graph(engine, prompts: list[list[int]], ids: torch.Tensor, mask: torch.Tensor, params: SamplingParams,
                 stop_ids: list[int], *, capture: bool, on_failure=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, T]`` tokens and log-probs: the first token as :func:`decode_static`, every later one by a
    whole-width step, captured once as a CUDA graph and replayed (``capture=False`` runs it uncaptured:
    the CPU's way of testing it). ``on_failure(reason)`` is called when the capture fails: it raises,
    or returns and the decode goes on uncaptured."""
    batch, width = ids.shape
    device = ids.device
    total = width + params.max_new_tokens
    state = DecodeState.start(batch, params, stop_ids, engine.pad_token_id, device)
    growing, first, positions = prefill_and_first_step(engine, prompts, ids, mask, params, state)
    cache, column = whole_width_cache(engine.model, growing, batch, total, width, device)
    del growing
    allowed = torch.cat([mask.bool(), mask.new_ones(batch, params.max_new_tokens, dtype=torch.bool)], dim=1)
    step = GraphStep(engine.model, state, cache, allowed, column, first.clone(), positions.clone())
    with static_attention(engine.model):
        for t in range(1, params.max_new_tokens):
            if t % CHECK_EVERY == 0 and state.finished():
                break
            if step.graph is not None:
                step.replay()
            elif capture and t == 1:  # the warm-up step, on a side stream as capture wants
                side = torch.cuda.Stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    step()
                torch.cuda.current_stream(device).wait_stream(side)
            elif capture:  # step 1 warmed cuBLAS and the allocator up
                capture = try_capture(step, on_failure)
                step.replay() if capture else step()
            else:
                step()
    return state.outputs()


def try_capture(step: GraphStep, on_failure) -> bool:
    """Capture ``step``; if the model's forward cannot be captured (a host synchronisation inside it, an
    operation CUDA graphs refuse), call ``on_failure(reason)`` (which raises, or accepts the uncaptured
    step) and return False. Nothing of the step ran: a capture records without executing."""
    try:
        step.capture()
    except Exception as error:  # noqa: BLE001 (what a failed capture raises varies by operation)
        step.graph = None
        on_failure(f"{type(error).__name__}: {error}".splitlines()[0][:300])
        return False
    return True
