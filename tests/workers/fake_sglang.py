"""A stand-in for SGLang 0.5.23 that breaks where SGLang breaks, for CPU tests of the SGLang engine.

SGLang cannot run a model without a GPU (``shared/notes/sglang-megatron.md`` §1), so rlite's SGLang
engine (:mod:`rlite.plugins.sglang`) is tested against this fake, which ships with the tests, not with
rlite (``tests/conftest.py`` puts this folder on ``sys.path``, for spawned ranks too): it records every call and raises :class:`RuleBroken` where the
real engine would fail or silently do the wrong thing (the rules are SGLang 0.5.23's, read from its
source; each ``_rule`` names what SGLang does). Two ways in:

* ``SGLangEngine(..., backend=FakeSGLang(...))``: the engine's calls, one object;
* :func:`fake_sglang_modules`: an importable ``sglang`` whose ``Engine(**server_args)`` is a
  :class:`FakeSGLangEngine`, so the ``sglang`` engine plugin, its ``ServerArgs`` and the in-process
  launch run unchanged (``monkeypatch.setitem(sys.modules, name, module)`` for each module).

Weights arrive as rlite's flattened buckets; the fake unpickles them with plain ``pickle`` and the
stand-in metadata class unless given SGLang's own reader.

Started with a speculative algorithm, the fake has a draft worker (``STANDALONE``, ``EAGLE``) whose
weights load with ``selector="draft"`` and are lost on a memory release without a CPU backup, refuses
what would load the policy into the draft (``selector="all"``) and lossy accept thresholds, and
reports acceptance in ``meta_info`` as SGLang 0.5.23 does (``spec_verify_ct``,
``spec_num_correct_drafts``, ``spec_num_proposed_drafts``, ``spec_accept_rate``, ``spec_accept_length``).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import pickle
import types
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rlite.plugins.sglang.payloads import CUDA_DEVICE_ARG, FLATTENED_BUCKET, FlattenedTensorMetadataFields

ALL_TAGS = ["kv_cache", "weights", "cuda_graph"]
"""SGLang's ``GPU_MEMORY_ALL_TYPES`` (``srt/constants.py``)."""


class RuleBroken(AssertionError):
    """rlite called the fake in an order or form that breaks the real SGLang."""


def pure_deserialize(payload):
    """``MultiprocessingSerializer.deserialize`` without SGLang's allowlist."""
    return pickle.loads(base64.b64decode(payload) if isinstance(payload, str) else payload)


def pure_reconstruct(data):
    """SGLang's ``FlattenedTensorBucket.reconstruct_tensors``, line for line."""
    flat = data["flattened_tensor"]
    return [(m.name, flat[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape)) for m in data["metadata"]]


PURE_READER = (pure_deserialize, pure_reconstruct, FlattenedTensorMetadataFields)


class FakeSGLang:
    """Records calls (``calls``); keeps the weights it was sent (``weights``) and the adapters loaded."""

    output_str = False
    routed_experts: tuple[int, int, int] | None = None
    """(layers, top_k, experts) when started with ``enable_return_routed_experts``."""

    def __init__(
        self,
        *,
        tp_size: int = 1,
        reader=PURE_READER,
        fail_on_bucket: int | None = None,
        cpu_backup: bool = False,
        memory_saver: bool = True,
        lora: bool = False,
        dtype: torch.dtype | None = None,
        quantization_config: dict | None = None,
        speculative_algorithm: str | None = None,
        num_draft_tokens: int = 5,
        draft_cpu_backup: bool = False,
    ) -> None:
        self.deserialize, self.reconstruct, self.metadata_cls = reader
        self.tp_size = tp_size
        self.fail_on_bucket = fail_on_bucket
        self.cpu_backup = cpu_backup
        self.memory_saver = memory_saver
        self.lora = lora
        self.dtype = dtype
        """The engine's dtype: a floating tensor of another dtype is cast on loading, as SGLang's
        ``param.data.copy_`` does (silently: the bytes that travelled are recorded in ``received``).
        None: kept as it arrives."""
        self.quantization_config = quantization_config
        self.calls: list[tuple] = []
        self.released: set[str] = set()
        self.session = False
        self.weights: dict[str, torch.Tensor] = {}
        """What TP rank 0 holds, by Hugging Face name (quantized weights as sent: e4m3 and scales)."""
        self.rank_weights: list[dict[str, torch.Tensor]] = [{} for _ in range(tp_size)]
        self.received: dict[str, torch.dtype] = {}
        """The dtype each tensor arrived in (last sync)."""
        self.corrupt: set[str] = set()
        """Test hook: tensors whose stored bytes are flipped after loading (a stale or raced buffer)."""
        self.weights_valid = True
        self.buckets = 0
        self.version = "default"
        self.adapters: dict[str, dict[str, torch.Tensor]] = {}
        self.speculative_algorithm = speculative_algorithm
        self.num_draft_tokens = num_draft_tokens
        self.draft_worker = speculative_algorithm in ("STANDALONE", "EAGLE", "EAGLE3")
        """A draft model with weights of its own (NGRAM has none)."""
        self.draft_cpu_backup = draft_cpu_backup or cpu_backup
        self.draft_weights: dict[str, torch.Tensor] = {}
        self.draft_weights_valid = True
        self.session_selector = "all"

    def _rule(self, ok: bool, message: str) -> None:
        if not ok:
            raise RuleBroken(f"SGLang rule broken: {message} (calls so far: {[c[0] for c in self.calls]})")

    # -- memory (scheduler_components/weight_updater.py) ----------------------------------------
    def release_memory_occupation(self, tags=None):
        self.calls.append(("release_memory_occupation", tags))
        tags = tags or ALL_TAGS
        self._rule(self.memory_saver, "release without enable_memory_saver frees nothing (a no-op adapter)")
        self._rule(not self.session, "release during a weight-update session")
        self._rule(not (set(tags) & self.released), f"release of already released {tags}")
        self.released |= set(tags)

    def resume_memory_occupation(self, tags=None):
        self.calls.append(("resume_memory_occupation", tags))
        tags = tags or ALL_TAGS
        self._rule(set(tags) <= self.released, f"resume of {tags}, not released (SGLang: KeyError)")
        self.released -= set(tags)
        if "weights" in tags and not self.cpu_backup:
            self.weights_valid = False  # the memory is back, its contents are not
        if "weights" in tags and self.draft_worker and not self.draft_cpu_backup:
            self.draft_weights_valid = False  # the draft's too (slime PR #971)

    # -- weight updates ---------------------------------------------------------------------------
    def begin_weight_update(self, selector="all"):
        self.calls.append(("begin_weight_update",) if selector == "all" else ("begin_weight_update", selector))
        self._rule(selector in ("target", "draft", "all"), f"selector {selector!r} (SGLang: ValueError)")
        self._rule(not self.session, "a weight-update session is already open")
        self._rule("weights" not in self.released, "loading weights into released memory")
        self.session = True
        self.session_selector = selector
        self.buckets = 0
        return (True, "Success")

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True, selector="all"):
        call = ("update_weights_from_tensor", load_format, flush_cache)
        self.calls.append(call if selector == "all" else (*call, selector))
        self._rule(self.session, "update_weights_from_tensor outside begin/end_weight_update")
        self._rule(
            selector == self.session_selector or self.session_selector == "all",
            f"selector {selector!r} in a session begun for {self.session_selector!r} (its runners were not prepared)",
        )
        self._rule(
            not (self.draft_worker and selector == "all"),
            "selector 'all' with a draft worker loads the policy's tensors into the draft model too",
        )
        self._rule(load_format == FLATTENED_BUCKET, f"load_format {load_format!r}")
        self._rule(
            len(named_tensors) == self.tp_size, f"{len(named_tensors)} payloads for tp_size {self.tp_size}"
        )
        per_rank = []
        for payload in named_tensors:
            data = self.deserialize(payload)
            self._rule(set(data) == {"flattened_tensor", "metadata"}, f"payload keys {sorted(data)}")
            per_rank.append(self.reconstruct(data))
        self.buckets += 1
        if self.fail_on_bucket == self.buckets - 1:
            return (False, "injected failure")
        self._rule(selector != "draft" or self.draft_worker, "selector 'draft' without a draft worker loads nothing")
        for rank, tensors in enumerate(per_rank):
            for name, tensor in tensors:
                kept = tensor.clone()
                floating = kept.dtype in (torch.float32, torch.float16, torch.bfloat16)
                if selector == "draft":  # the draft model's own parameters (TP rank 0's shown)
                    if rank == 0:
                        self.draft_weights[name] = kept.to(self.dtype) if self.dtype is not None and floating else kept
                    continue
                self._check_quantized(name, tensor)
                if rank == 0:
                    self.received[name] = tensor.dtype
                if self.dtype is not None and floating and not name.endswith("_scale_inv"):
                    kept = kept.to(self.dtype)  # SGLang's param.data.copy_ casts to the parameter's dtype
                if name in self.corrupt:
                    kept.view(torch.uint8).view(-1)[0] ^= 1
                self.rank_weights[rank][name] = kept
        self.weights = self.rank_weights[0]
        return (True, "Success")

    def _quantized(self, name: str) -> bool:
        """A weight of a linear layer of a decoder block: an FP8 parameter when the engine runs FP8
        (``Fp8Config.get_quant_method`` gives ``Fp8LinearMethod`` to ``LinearBase`` layers only)."""
        return self.quantization_config is not None and ".layers." in name and name.endswith("_proj.weight")

    def _check_quantized(self, name: str, tensor: torch.Tensor) -> None:
        if self._quantized(name):
            self._rule(
                tensor.dtype == torch.float8_e4m3fn,
                f"{name} arrived as {tensor.dtype} for an FP8 parameter: SGLang's weight loader copies it into "
                "the e4m3 weight and leaves weight_scale_inv as it was (wrong weights, no error)",
            )
        if name.endswith("_scale_inv"):
            self._rule(self._quantized(name.removesuffix("_scale_inv")), f"{name}: a scale without an FP8 weight")
            self._rule(tensor.dtype == torch.float32, f"{name} arrived as {tensor.dtype}, SGLang's scales are fp32")

    def end_weight_update(self):
        self.calls.append(("end_weight_update",))
        self._rule(self.session, "end_weight_update without begin")
        if self.quantization_config is not None:  # process_weights_after_loading needs weight and scale
            for name in [n for n in self.weights if self._quantized(n)]:
                self._rule(f"{name}_scale_inv" in self.weights, f"{name} has no weight_scale_inv")
        self.session = False
        if self.session_selector in ("target", "all"):
            self.weights_valid = True
        if self.session_selector in ("draft", "all"):
            self.draft_weights_valid = True
        return (True, "Success")

    def served_weights(self) -> dict[str, torch.Tensor]:
        """The weights TP rank 0 computes with: FP8 weights dequantized with their block scales."""
        out = {}
        for name, tensor in self.weights.items():
            if name.endswith("_scale_inv"):
                continue
            if self._quantized(name):
                block = self.quantization_config["weight_block_size"][0]
                scale = self.weights[f"{name}_scale_inv"]
                full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[: tensor.shape[0], : tensor.shape[1]]
                tensor = tensor.float() * full
            out[name] = tensor
        return out

    # -- the weight checker (utils/weight_checker.py) ---------------------------------------------
    @staticmethod
    def tensor_hash(tensor: torch.Tensor) -> int:
        """SGLang's ``tensor_hash`` on a CPU tensor: the first 8 bytes of the SHA-256 of its bytes."""
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        return int.from_bytes(hashlib.sha256(memoryview(data)).digest()[:8], "big")

    def check_weights(self, action="checksum"):
        """``check_weights(action="checksum")``: one ChecksumInfo per TP rank, keyed by SGLang's own
        parameter names (q/k/v and gate/up fused as SGLang's Llama/Qwen2 models hold them)."""
        self.calls.append(("check_weights", action))
        self._rule(action == "checksum", f"action {action!r}")
        self._rule(not self.session, "check_weights inside a session")
        self._rule("weights" not in self.released, "check_weights with released weights")
        ranks = []
        for rank, weights in enumerate(self.rank_weights):
            params = sglang_parameters(weights)
            checksums = {name: f"{self.tensor_hash(t):016x}" for name, t in params.items()}
            ranks.append({"checksums": checksums, "per_gpu_checksum": "", "parallelism_info": [{"tp_rank": rank}]})
        return (True, "Success.", ranks, "")

    def update_weight_version(self, version):
        self.calls.append(("update_weight_version", version))
        self._rule(not self.session, "version update inside a session")
        self.version = version

    def flush_cache(self):
        self.calls.append(("flush_cache",))
        self._rule(not self.session, "flush_cache inside a session")

    # -- LoRA adapters (the adapter pool is not in the "weights" region: released weights keep it) --
    def load_lora_adapter_from_tensors(self, *, lora_name, tensors, config_dict, load_format=None):
        self.calls.append(("load_lora_adapter_from_tensors", lora_name))
        self._rule(self.lora, "LoRA is not enabled (enable_lora)")
        self._rule(lora_name not in self.adapters, f"adapter {lora_name} loaded twice")
        self.adapters[lora_name] = {name: tensor.clone() for name, tensor in dict(tensors).items()}
        return {"success": True, "error_message": None}

    def unload_lora_adapter(self, *, lora_name):
        self.calls.append(("unload_lora_adapter", lora_name))
        self._rule(lora_name in self.adapters, f"unloading unknown adapter {lora_name}")
        del self.adapters[lora_name]
        return {"success": True, "error_message": None}

    # -- generation -------------------------------------------------------------------------------
    def generate(self, *, input_ids, sampling_params, return_logprob, lora_path=None, return_routed_experts=False,
                 top_logprobs_num=None):
        self.calls.append(("generate", len(input_ids)))
        self._rule(not self.released, f"generate with {sorted(self.released)} released")
        self._rule(not self.session, "generate inside a weight-update session")
        self._rule(self.weights_valid, "generate with lost weights (released without a CPU backup, not reloaded)")
        self._rule(
            self.draft_weights_valid,
            "generate with lost draft weights (released without enable_draft_weights_cpu_backup, not reloaded)",
        )
        self._rule(return_logprob, "rlite needs log-probs")
        self._rule(len(sampling_params) == len(input_ids), "one sampling-params dict per request")
        if lora_path is not None:
            self._rule(len(lora_path) == len(input_ids), "one adapter name per request")
            self._rule(all(name in self.adapters for name in lora_path), f"unknown adapter in {set(lora_path)}")
        outputs = []
        for ids, sp in zip(input_ids, sampling_params):
            tokens = [(sum(ids) + k) % 50 + 2 for k in range(sp["max_new_tokens"])]
            entries = [(-0.25 * (k + 1), t, None) for k, t in enumerate(tokens)]
            meta = {
                "output_token_logprobs": entries,
                "finish_reason": {"type": "length", "length": len(tokens)},
                "weight_version": self.version,
                "completion_tokens": len(tokens),
            }
            if top_logprobs_num:  # per token, the k most likely (logprob, id, text), most likely first
                meta["output_top_logprobs"] = [
                    [(-0.25 * (k + 1) - j, (t + j) % 50 + 2, None) for j in range(top_logprobs_num)]
                    for k, t in enumerate(tokens)
                ]
            if self.speculative_algorithm is not None and tokens:
                # a made-up but consistent account: every other verification accepted one draft token
                verify = (len(tokens) + 1) // 2
                correct = len(tokens) - verify
                proposed = verify * (self.num_draft_tokens - 1)
                meta.update(
                    spec_verify_ct=verify, spec_num_correct_drafts=correct, spec_num_proposed_drafts=proposed,
                    spec_accept_rate=correct / proposed, spec_accept_length=len(tokens) / verify,
                )
            if return_routed_experts:  # [prompt + output - 1, layers, top_k] int32, base64 (SGLang's layout)
                self._rule(self.routed_experts is not None, "return_routed_experts without enable_return_routed_experts")
                layers, top_k, experts = self.routed_experts
                rows = len(ids) + len(tokens) - 1
                values = (np.arange(rows * layers * top_k, dtype=np.int32) + sum(ids)) % experts
                meta["routed_experts"] = base64.b64encode(values.tobytes()).decode()
            outputs.append({"text": None, "output_ids": tokens, "meta_info": meta})
        return outputs

    def shutdown(self):
        self.calls.append(("shutdown",))


FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
         "up_proj": "gate_up_proj"}  # fmt: skip
"""SGLang's ``stacked_params_mapping`` of Llama/Qwen2: Hugging Face projections it holds fused."""


def sglang_parameters(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face-named tensors as SGLang's Llama/Qwen2 parameters: q/k/v and gate/up concatenated
    under their fused names, everything else under its own."""
    params: dict[str, torch.Tensor] = {}
    fused: dict[str, list[torch.Tensor]] = {}
    for name, tensor in sorted(weights.items()):
        parts = name.split(".")
        hits = [i for i, part in enumerate(parts) if part in FUSED]
        if hits:
            parts[hits[0]] = FUSED[parts[hits[0]]]
            fused.setdefault(".".join(parts), []).append(tensor)
        else:
            params[name] = tensor
    params.update({name: torch.cat([t.reshape(-1) for t in parts]) for name, parts in fused.items()})
    return params


def receiving_rebuild(visible_gpus: tuple[str, ...]):
    """``rebuild_cuda_tensor`` as SGLang's receivers run it after ``monkey_patch_torch_reductions()``
    (``utils/patch_torch.py: _rebuild_cuda_tensor_modified``) in a process that sees ``visible_gpus``:
    a UUID is mapped to that process's index of the GPU; an int passes through unchanged, which names
    whatever GPU has that index there. Returns ``(device index, handle args)`` instead of a tensor (a
    CPU test has no CUDA): what the receiving process would open."""

    def rebuild(*args):
        device = args[CUDA_DEVICE_ARG]
        if isinstance(device, str):
            if device not in visible_gpus:
                raise RuleBroken(f"SGLang: Invalid device_uuid={device} (its process sees {list(visible_gpus)})")
            device = visible_gpus.index(device)
        return ("cuda", device, args)

    return rebuild


def open_cuda_payload(payload: bytes, visible_gpus: tuple[str, ...]):
    """Unpickle a payload as an SGLang receiver that sees ``visible_gpus`` would: CUDA handles come back
    as ``("cuda", device index there, args)``."""
    import io

    rebuild = receiving_rebuild(visible_gpus)

    class Receiver(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
                return rebuild
            return super().find_class(module, name)

    return Receiver(io.BytesIO(payload)).load()


# --------------------------------------------------------------------------------------------------
# an importable `sglang` whose Engine is the fake
# --------------------------------------------------------------------------------------------------


class FakeSGLangEngine(FakeSGLang):
    """``sglang.Engine(**server_args)``: the ServerArgs it was built with decide its rules."""

    instances: list[FakeSGLangEngine] = []
    """Every engine built since :func:`fake_sglang_modules` (in order)."""

    def __init__(self, **server_args: Any) -> None:
        overrides = json.loads(server_args.get("json_model_override_args") or "{}")
        algorithm = server_args.get("speculative_algorithm")
        super().__init__(
            tp_size=int(server_args.get("tp_size", 1)),
            cpu_backup=bool(server_args.get("enable_weights_cpu_backup", False)),
            memory_saver=bool(server_args.get("enable_memory_saver", False)),
            lora=bool(server_args.get("enable_lora", False)),
            dtype=getattr(torch, server_args.get("dtype", "bfloat16")),
            quantization_config=overrides.get("quantization_config"),
            speculative_algorithm=algorithm,
            num_draft_tokens=int(server_args.get("speculative_num_draft_tokens") or 5),
            draft_cpu_backup=bool(server_args.get("enable_draft_weights_cpu_backup", False)),
        )
        self.server_args = server_args
        if algorithm is not None:
            self._check_speculative_args(server_args)
        if server_args.get("enable_return_routed_experts"):  # (layers, top_k, experts) of the fake's MoE
            self.routed_experts = (2, 2, 4)
        self.loop = asyncio.new_event_loop()
        self.tokenizer_manager = types.SimpleNamespace(
            update_weight_version=self._update_weight_version_async,
            check_weights=self._check_weights_async,
            update_weights_from_tensor=self._update_weights_from_tensor_async,
        )
        FakeSGLangEngine.instances.append(self)

    def _check_speculative_args(self, args: dict[str, Any]) -> None:
        """SGLang 0.5.23's rules for the speculative arguments rlite sets (``srt/arg_groups``)."""
        algorithm = args["speculative_algorithm"]
        self._rule(algorithm in ("EAGLE", "EAGLE3", "STANDALONE", "NGRAM"), f"speculative_algorithm {algorithm!r}")
        self._rule(
            args.get("speculative_accept_threshold_single", 1.0) == 1.0
            and args.get("speculative_accept_threshold_acc", 1.0) == 1.0,
            "accept thresholds below 1.0 are lossy (samples no longer follow the policy)",
        )
        if algorithm == "NGRAM":
            self._rule(not args.get("speculative_draft_model_path"), "NGRAM takes no draft model")
            return
        self._rule(bool(args.get("speculative_draft_model_path")), f"{algorithm} needs speculative_draft_model_path")
        if args.get("speculative_eagle_topk") == 1:
            self._rule(
                args.get("speculative_num_draft_tokens") == args.get("speculative_num_steps", 0) + 1,
                "with topk 1 SGLang resets speculative_num_draft_tokens to speculative_num_steps + 1",
            )
        draft_format = args.get("speculative_draft_load_format") or args.get("load_format")
        self.draft_weights_valid = draft_format != "dummy"  # random until a draft session loads them

    async def _update_weight_version_async(self, request) -> None:
        self.update_weight_version(request.new_version)

    async def _check_weights_async(self, request, http_request=None):
        return self.check_weights(request.action)

    async def _update_weights_from_tensor_async(self, request, http_request=None) -> tuple[bool, str]:
        return self.update_weights_from_tensor(
            request.serialized_named_tensors, load_format=request.load_format, flush_cache=request.flush_cache,
            selector=request.selector,
        )

    def get_all_child_pids(self) -> list[int]:
        return []

    def shutdown(self):
        super().shutdown()
        self.loop.close()


@dataclass
class _UpdateWeightVersionReqInput:
    new_version: str
    abort_all_requests: bool = True


@dataclass
class _CheckWeightsReqInput:
    action: str = "checksum"
    allow_quant_error: bool = False
    skip_tensor_list: list | None = None
    selector: str = "all"


@dataclass(kw_only=True)
class _UpdateWeightsFromTensorReqInput:
    serialized_named_tensors: list
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    selector: str = "all"
    torch_empty_cache: bool = False


def fake_sglang_modules() -> dict[str, types.ModuleType]:
    """``{module name: module}`` for ``sys.modules``: ``sglang`` (``Engine``), the request classes, the
    metadata class and ``tensor_hash`` rlite imports from it. Clears :attr:`FakeSGLangEngine.instances`."""
    FakeSGLangEngine.instances = []
    modules = {name: types.ModuleType(name) for name in (
        "sglang", "sglang.srt", "sglang.srt.managers", "sglang.srt.managers.io_struct",
        "sglang.srt.weight_sync", "sglang.srt.weight_sync.tensor_bucket", "sglang.srt.managers.mm_utils",
    )}  # fmt: skip
    for name, module in modules.items():
        module.__path__ = []  # a package, so its submodules import
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(modules[parent], child, module)
    modules["sglang"].Engine = FakeSGLangEngine
    modules["sglang"].__version__ = "0.5.23"
    modules["sglang.srt.managers.io_struct"].UpdateWeightVersionReqInput = _UpdateWeightVersionReqInput
    modules["sglang.srt.managers.io_struct"].CheckWeightsReqInput = _CheckWeightsReqInput
    modules["sglang.srt.managers.mm_utils"].tensor_hash = FakeSGLang.tensor_hash
    modules["sglang.srt.managers.io_struct"].UpdateWeightsFromTensorReqInput = _UpdateWeightsFromTensorReqInput
    modules["sglang.srt.weight_sync.tensor_bucket"].FlattenedTensorMetadata = FlattenedTensorMetadataFields
    return modules
