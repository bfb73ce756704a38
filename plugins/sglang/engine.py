"""SGLang rollout engine (GPU), colocated with the trainer, fed weights as flattened CUDA-IPC buckets.

Written against SGLang 0.5.23 (``shared/notes/sglang-megatron.md`` and its source). SGLang is never
imported at module level: everything here that runs without it (the payload, the call sequence, the
conversion of outputs) is a pure function, tested on CPU against a fake engine that enforces SGLang's
rules and against SGLang's own deserializer.

One colocated step, as the loop drives :class:`SGLangEngine` (``rlite.engines.base``)::

    generate()        -> generate(input_ids=..., return_logprob=True)  # the rollout
    release_memory()  -> release_memory_occupation(["weights", "kv_cache", "cuda_graph"])
                                                                    # right after it: the trainer's turn
    update_weights()  -> resume_memory_occupation(["weights"])      # after the optimizer step
                         begin_weight_update()
                         update_weights_from_tensor(payloads, load_format="flattened_bucket",
                                                    flush_cache=False)      # once per bucket
                         end_weight_update()                                 # also on failure
                         update_weight_version(str(version))
                         check_weights(action="checksum")    # SGLang's hashes vs the sent bytes'
    resume_memory()   -> resume_memory_occupation(["kv_cache", "cuda_graph"]); flush_cache()

An engine that serves LoRA adapters over its own base weights (``fixed_base=True``, for
``rollout.lora_sync: adapter``) never receives those weights again, so it releases only the KV cache
and CUDA graphs, unless SGLang keeps a CPU copy of the weights (``enable_weights_cpu_backup``).

A payload is, per tensor-parallel rank, ``MultiprocessingSerializer.serialize({"flattened_tensor":
uint8 buffer, "metadata": [FlattenedTensorMetadata(name, shape, dtype, start_idx, end_idx, numel)]})``
(``numel`` and the indices count bytes). The buffer is rlite's :func:`pack_bucket` layout, each tensor
at a 64-byte-aligned offset, so every ``view(dtype)`` on the receiving side is aligned. A CUDA buffer
pickles to a CUDA-IPC handle (no copy) that names its GPU by UUID, as SGLang's patched reductions do
(:func:`~rlite.plugins.sglang.payloads.reduce_tensor_by_device_uuid`). Tensors travel in the engine's
dtype (the sync casts them: ``EngineCapabilities.weight_dtype``), or as FP8 with block scales when the
engine runs quantized rollouts (``quantization_config``). A fresh buffer is made for every bucket and dropped after
SGLang has loaded it: SGLang does not synchronize the device before answering, so reusing a buffer
could race its copy; torch's IPC reference counting keeps a dropped buffer alive until SGLang lets go.

Two launch modes: ``"engine"`` (``sglang.Engine`` in this process, driven from one worker thread so
every call can time out) and ``"server"`` (``python -m sglang.launch_server`` on 127.0.0.1, spoken to
over HTTP, with a health check and a start timeout). Weights travel only as CUDA-IPC handles: an
engine is colocated with the trainer ranks whose GPUs it runs on. (SGLang's NCCL path,
``init_weights_update_group`` + ``update_weights_from_distributed``, needs the trainer and the engine
on different GPUs: NCCL refuses two ranks of one communicator on the same device. rlite has no such
layout, so it does not use that path.)

An engine may run on the GPUs of several trainer ranks (``group``,
:mod:`rlite.plugins.sglang.group`): this rank drives it, the others hand it their prompts and their
weight payloads, and TP rank i loads trainer rank i's (:mod:`rlite.plugins.sglang.placement` lays the
engines out).

Adapter-only LoRA sync (:meth:`SGLangEngine.update_lora_adapter`) works in both modes: the adapter goes
through ``load_lora_adapter_from_tensors`` under a versioned name, and every request names it
(``lora_path``); the HTTP contract is written out at :meth:`ServerBackend.load_lora_adapter_from_tensors`.

A speculative draft (``draft=DraftSpec(...)``) becomes SGLang's ``STANDALONE`` / ``EAGLE`` / ``NGRAM``
arguments; a trained draft's weights follow the policy's in a session of their own (``selector``),
and acceptance is read from every request's ``meta_info`` (:mod:`rlite.plugins.sglang.speculative`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from rlite.api import (
    Completion,
    DraftSpec,
    EngineCapabilities,
    EngineError,
    SamplingParams,
    SpeculationStats,
)
from rlite.plugins.sglang.group import EngineGroup, generate_for_group
from rlite.plugins.sglang.launch import InProcessBackend, ServerBackend
from rlite.plugins.sglang.payloads import (
    REST_TAGS,
    WEIGHT_TAGS,
    check_reply,
    completion_from_output,
    dtype_name,
    resolve_engine_dtype,
    sampling_params_for,
    sglang_metadata_cls,
)
from rlite.plugins.sglang.speculative import (
    speculation_from_outputs,
    speculative_server_args,
    sync_policy_and_draft,
    top_logprobs_from_output,
)

# --------------------------------------------------------------------------------------------------
# the engine
# --------------------------------------------------------------------------------------------------


class SGLangEngine:
    """A colocated SGLang engine with rlite's :class:`~rlite.engines.base.RolloutEngine` interface."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        eos_token_ids: Iterable[int] = (),
        pad_token_id: int | None = None,
        timeout_s: float = 600.0,
        start_timeout_s: float | None = None,
        true_on_policy: bool = False,
        bucket_bytes: int = 512 << 20,
        tp_size: int = 1,
        launch: str = "engine",
        load_format: str = "dummy",
        mem_fraction_static: float | None = None,
        dtype: str = "auto",
        engine_kwargs: dict[str, Any] | None = None,
        fixed_base: bool = False,
        routed_experts: tuple[int, int] | None = None,
        base_gpu_id: int | None = None,
        quantization_config: dict[str, Any] | None = None,
        verify_weights: bool = True,
        group: EngineGroup | None = None,
        draft: DraftSpec | None = None,
        backend: Any = None,
    ) -> None:
        """Start SGLang on ``model_path`` (``launch="engine"`` or ``"server"``) with random weights.

        ``load_format="dummy"`` (the default) starts from random weights: the first
        :meth:`update_weights` brings the trainer's. ``true_on_policy`` turns on SGLang's deterministic
        inference and its FSDP on-policy target. ``engine_kwargs`` go to SGLang's ``ServerArgs``
        unchanged. ``fixed_base``: the engine loaded its real base weights and will only ever receive
        LoRA adapters (:meth:`update_lora_adapter`), so :meth:`release_memory` must not lose them.
        ``routed_experts = (num_hidden_layers, top_k)`` of an MoE model starts SGLang with
        ``enable_return_routed_experts`` so that a rollout can report every token's experts.
        ``dtype`` is resolved as SGLang resolves it (``"auto"``: the checkpoint's) and passed explicitly;
        weights are sent in it. ``base_gpu_id``: the GPU of TP rank 0 (:mod:`rlite.plugins.sglang.placement`).
        ``quantization_config``: the Hugging Face ``quantization_config`` of the pre-quantized weights the
        engine is sent (rollout quantization); the engine starts with it as a model override and runs
        quantized kernels. ``verify_weights``: after every sync, compare SGLang's checksums of the tensors
        it holds unchanged with the sent bytes. ``group``: the trainer ranks on the engine's GPUs (this
        rank leads; the others' prompts and payloads come through it). ``backend`` replaces SGLang
        altogether (tests). ``draft`` starts SGLang with speculative decoding
        (:mod:`rlite.plugins.sglang.speculative`).
        """
        self.routing_layout = routed_experts
        self.draft = draft
        self._speculation = SpeculationStats()
        self.eos_token_ids = sorted({int(t) for t in eos_token_ids})
        self.pad_token_id = pad_token_id
        self.timeout_s = float(timeout_s)
        self.bucket_bytes = int(bucket_bytes)
        self.tp_size = int(tp_size)
        self.true_on_policy = true_on_policy
        self.group = group
        self.verify_weights = verify_weights
        self.weight_dtype = (
            backend.dtype if hasattr(backend, "dtype") else resolve_engine_dtype(dtype, read_model_config(model_path))
        )
        """SGLang's dtype for this model (a stand-in backend may state its own); what the sync sends."""
        if quantization_config is not None:
            check_reloadable_quantization(quantization_config)
        self.capabilities = EngineCapabilities(
            lora_adapters=True, routed_experts=routed_experts is not None, weight_dtype=self.weight_dtype,
            quantized_layout=quantization_config is not None, reacquires_device_memory=True,
            draft_methods=("model", "ngram", "eagle"),
        )  # fmt: skip
        """Serves LoRA adapters over its base (``update_lora_adapter``), reports routed experts when
        started with ``routed_experts``, wants its weights in its dtype (or FP8 with scales)."""
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        """Where buckets are packed: CPU-offloaded trainer weights go to the GPU before the handoff."""
        self.weight_version = 0
        self.lora_name: str | None = None
        """The adapter every request names (adapter-only LoRA sync), or None."""
        self._released: list[str] = []
        self.fixed_base = fixed_base
        self._weights_backup = bool((engine_kwargs or {}).get("enable_weights_cpu_backup", False))
        self._weights_lost = False
        """Weights were released without a CPU backup and no sync has rewritten them yet."""
        if backend is None:
            kwargs: dict[str, Any] = dict(
                model_path=str(model_path),
                skip_tokenizer_init=True,
                enable_memory_saver=True,
                load_format=load_format,
                tp_size=self.tp_size,
                dtype=dtype_name(self.weight_dtype),
            )
            if base_gpu_id is not None:
                kwargs.update(base_gpu_id=int(base_gpu_id), gpu_id_step=1)
            if mem_fraction_static is not None:
                kwargs["mem_fraction_static"] = mem_fraction_static
            if quantization_config is not None:
                kwargs["json_model_override_args"] = with_quantization_config(
                    (engine_kwargs or {}).get("json_model_override_args"), quantization_config
                )
            if true_on_policy:
                kwargs.update(enable_deterministic_inference=True, rl_on_policy_target="fsdp")
            if routed_experts is not None:
                kwargs["enable_return_routed_experts"] = True
            if draft is not None:
                kwargs.update(speculative_server_args(draft))
            user_kwargs = dict(engine_kwargs or {})
            if "json_model_override_args" in kwargs:  # the user's overrides are merged into it above
                user_kwargs.pop("json_model_override_args", None)
            kwargs.update(user_kwargs)
            start = start_timeout_s if start_timeout_s is not None else self.timeout_s
            if launch == "engine":
                backend = InProcessBackend(kwargs, start_timeout_s=start, timeout_s=self.timeout_s)
            elif launch == "server":
                backend = ServerBackend(kwargs, start_timeout_s=start, timeout_s=self.timeout_s)
            else:
                raise ValueError(f"launch must be 'engine' or 'server', got {launch!r}")
        self.backend = backend

    # -- generation ---------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        if self.group is not None:  # every rank of the group calls this; one SGLang batch serves them all
            return generate_for_group(self._generate, self.group, prompts, params)
        return self._generate(prompts, params)

    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        if not prompts:
            return []
        if self._released:
            self.resume_memory()
        if self._weights_lost:
            raise EngineError(
                "SGLang's weights were released (no CPU backup) and not synced since; call update_weights"
            )
        expanded = [list(map(int, p)) for p in prompts for _ in range(params.n)]  # groups stay contiguous
        seeds = None
        if self.true_on_policy:  # SGLang uses per-request seeds only with deterministic inference
            base = params.seed if params.seed is not None else int(torch.randint(0, 2**31 - 1, ()).item())
            seeds = [base + i for i in range(len(expanded))]
        sampling = sampling_params_for(
            params, stop_token_ids=set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids)),
            seeds=seeds
        )
        if seeds is None:
            sampling = sampling * len(expanded)
        extra: dict[str, Any] = {"lora_path": [self.lora_name] * len(expanded)} if self.lora_name is not None else {}
        if params.return_routed_experts:
            if self.routing_layout is None:
                raise EngineError("return_routed_experts: this SGLang engine was started without routed_experts")
            extra["return_routed_experts"] = True
        if params.top_logprobs:
            extra["top_logprobs_num"] = params.top_logprobs
        start = time.perf_counter()
        outputs = self.backend.generate(
            input_ids=expanded, sampling_params=sampling, return_logprob=True, **extra
        )
        elapsed = time.perf_counter() - start
        if isinstance(outputs, dict):
            outputs = [outputs]
        if len(outputs) != len(expanded):
            raise EngineError(f"SGLang returned {len(outputs)} outputs for {len(expanded)} requests")
        if self.draft is not None:
            self._speculation = speculation_from_outputs(outputs, self.draft, elapsed)
        completions = []
        for row, output in enumerate(outputs):
            served = output.get("meta_info", {}).get("weight_version")
            if served is not None and str(served) not in (str(self.weight_version), "default"):
                raise EngineError(
                    f"SGLang sampled with weight version {served!r}, expected {self.weight_version}"
                )
            routing = (len(expanded[row]), *self.routing_layout) if params.return_routed_experts else None
            completion = completion_from_output(
                output, prompt_index=row // params.n, weight_version=self.weight_version, routing=routing
            )
            if params.top_logprobs:
                completion.top_ids, completion.top_logprobs = top_logprobs_from_output(output, params.top_logprobs)
            completions.append(completion)
        return completions

    def speculation_stats(self) -> SpeculationStats:
        """What the draft did in the last ``generate``, from SGLang's per-request meta data."""
        return self._speculation

    # -- weights ------------------------------------------------------------------------------
    def update_lora_adapter(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], config: dict[str, Any], version: int
    ) -> None:
        """Adapter-only sync: load the new adapter under a versioned name, then drop the old one.

        The engine must have been started with its real base weights, ``enable_lora`` and
        ``fixed_base=True`` (the ``sglang`` engine plugin does this when ``rollout.lora_sync:
        adapter``). Generation then names the adapter in every request, so a sample can never come
        from a stale adapter.
        """
        if not self.fixed_base:
            raise EngineError(
                "update_lora_adapter: this engine was not started to serve adapters over its own base "
                "weights (SGLangEngine(fixed_base=True)); released weights would be lost and no sync "
                "would restore them"
            )
        self._resume(WEIGHT_TAGS)  # only with a CPU backup were they released
        name = f"rlite_v{int(version)}"
        tensors = {key: tensor.contiguous() for key, tensor in named_tensors}
        check_reply(
            self.backend.load_lora_adapter_from_tensors(lora_name=name, tensors=tensors, config_dict=config),
            "load_lora_adapter_from_tensors",
        )
        previous, self.lora_name = self.lora_name, name
        if previous is not None:
            check_reply(self.backend.unload_lora_adapter(lora_name=previous), "unload_lora_adapter")
        check_reply(self.backend.update_weight_version(str(int(version))), "update_weight_version")
        self.weight_version = int(version)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | None, version: int) -> None:
        """Flattened CUDA-IPC buckets through ``update_weights_from_tensor``, then switch to ``version``.

        With a draft worker the policy loads with ``selector="target"`` and a trained draft's tensors
        (``draft.`` names, after the policy's) with ``selector="draft"``, each in its own session."""
        self._resume(WEIGHT_TAGS)
        common = dict(
            bucket_bytes=self.bucket_bytes,
            tp_size=self.tp_size,
            metadata_cls=getattr(self.backend, "metadata_cls", None) or sglang_metadata_cls(),
            output_str=self.backend.output_str,
            device=self.device,
            group=self.group,
            tensor_hash=self.backend.tensor_hash if self.verify_weights else None,
            weight_dtype=self.weight_dtype,
        )
        sync_policy_and_draft(self.backend, named_tensors or (), version, self.draft, **common)
        self._weights_lost = False
        self.weight_version = int(version)

    # -- memory -------------------------------------------------------------------------------
    def release_memory(self) -> None:
        """Free weights, KV cache and CUDA graphs (the engine must be idle); an engine with a fixed base
        keeps its weights unless SGLang backs them up to CPU, because no sync would bring them back."""
        keep_weights = self.fixed_base and not self._weights_backup
        todo = [t for t in (REST_TAGS if keep_weights else WEIGHT_TAGS + REST_TAGS) if t not in self._released]
        if not todo:
            return
        check_reply(self.backend.release_memory_occupation(tags=todo), f"release_memory_occupation({todo})")
        self._released += todo

    def resume_memory(self) -> None:
        """Re-acquire what :meth:`release_memory` freed (weights too, if no sync resumed them) and flush."""
        self._resume(WEIGHT_TAGS)
        self._resume(REST_TAGS)
        check_reply(self.backend.flush_cache(), "flush_cache")

    def _resume(self, tags: list[str]) -> None:
        todo = [t for t in tags if t in self._released]
        if "weights" in todo and not self._weights_backup:
            self._weights_lost = True  # resumed memory, old contents gone until a sync writes them
        if todo:
            check_reply(self.backend.resume_memory_occupation(tags=todo), f"resume_memory_occupation({todo})")
            self._released = [t for t in self._released if t not in todo]

    def shutdown(self) -> None:
        backend, self.backend = self.backend, None
        if backend is not None:
            backend.shutdown()


RELOADABLE_QUANTIZATION = {"fp8"}
"""``quant_method``s whose SGLang 0.5.23 linear method keeps its weight parameters when it processes them
after loading, so an in-place weight update can load the next quantized weights: FP8 with block scales
(``layers/quantization/fp8.py``: ``process_weights_after_loading_block_quant`` updates ``.data``).
W8A8-INT8 replaces its weight with a transposed copy and has no ``restore_weights_before_loading``."""


def check_reloadable_quantization(quantization_config: dict[str, Any]) -> None:
    from rlite.api import ConfigError

    method = quantization_config.get("quant_method")
    if method not in RELOADABLE_QUANTIZATION:
        raise ConfigError(
            f"rollout.quantization: SGLang cannot load {method!r} weights into a running engine (its linear "
            f"layers do not keep their parameters after processing them); use fp8_blockwise"
        )
    if method == "fp8" and not quantization_config.get("weight_block_size"):
        raise ConfigError("rollout.quantization: SGLang reloads FP8 weights only with block scales (weight_block_size)")


def with_quantization_config(overrides: str | dict | None, quantization_config: dict[str, Any]) -> str:
    """SGLang's ``json_model_override_args`` with ``quantization_config`` set (a user's other overrides
    kept): the engine then builds FP8 linear layers from a checkpoint config that declares none."""
    from rlite.api import ConfigError

    merged = json.loads(overrides) if isinstance(overrides, str) else dict(overrides or {})
    if "quantization_config" in merged and merged["quantization_config"] != quantization_config:
        raise ConfigError(
            "rollout.engine.args.engine_kwargs.json_model_override_args: sets a quantization_config that "
            "differs from rollout.quantization's"
        )
    merged["quantization_config"] = quantization_config
    return json.dumps(merged)


def read_model_config(model_path: str | Path) -> dict[str, Any]:
    """The checkpoint's ``config.json`` (empty if there is none, e.g. a test's stand-in path)."""
    path = Path(model_path) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}
