"""A tiny byte-level tokenizer and a tiny random Qwen2 model, built offline for tests and the quickstart.

The tokenizer is a byte-level BPE with no merges: every byte is one token, spelled through the
GPT-2/Qwen2 byte-to-unicode map, plus three special tokens (``<|endoftext|>`` as pad, ``<|im_start|>``
and ``<|im_end|>`` as eos) and a ChatML chat template. Vocabulary: 256 bytes + 3 specials = 259.

A byte-level BPE (rather than a character-level WordLevel) is what survives ``save_pretrained`` and
``AutoTokenizer.from_pretrained`` exactly: transformers rebuilds the tokenizer of a ``model_type=qwen2``
folder as a ``Qwen2Tokenizer`` (a WordLevel one silently loses ``\\n`` on that path). So the pipeline
here is the one ``Qwen2Tokenizer`` builds (NFC normaliser, Qwen2 split regex, byte-level), which
makes the tokenizer in memory and the reloaded one encode every string identically.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML, as used by Qwen2: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message."""

# The pre-tokenisation split of Qwen2 (GPT-4 style, single digits). With no merges it does not change
# the ids, but matching it keeps offsets and any future merges identical after a reload.
QWEN2_SPLIT_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


def bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 map from each byte to a printable unicode character (bytes that are printable map to themselves)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    codepoints = printable[:]
    shift = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codepoints.append(256 + shift)
            shift += 1
    return {byte: chr(cp) for byte, cp in zip(printable, codepoints)}


def build_byte_tokenizer():
    """Build the 259-token byte-level tokenizer with ChatML specials and chat template.

    Ids 0-255 are the bytes in order, then ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos).
    """
    from transformers import PreTrainedTokenizerFast

    byte_map = bytes_to_unicode()
    vocab = {byte_map[byte]: byte for byte in range(256)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START],
        clean_up_tokenization_spaces=False,
        model_max_length=512,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def tiny_model_config(family: str, num_experts: int | None, common: dict, *, head_dim: int, experts_per_token: int,
                      expert_intermediate: int):
    """The Hugging Face config and model class of :func:`build_tiny_model_dir`'s model: ``common`` settings, a
    dense ``family`` model, or with ``num_experts`` a Qwen3 MoE one."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    if num_experts is None and family == "llama":
        return LlamaConfig(**common), LlamaForCausalLM
    if num_experts is None:
        return Qwen2Config(**common), Qwen2ForCausalLM
    config = Qwen3MoeConfig(
        **common, head_dim=head_dim, num_experts=num_experts, num_experts_per_tok=experts_per_token,
        moe_intermediate_size=expert_intermediate, norm_topk_prob=True,
    )
    return config, Qwen3MoeForCausalLM


def build_tiny_model_dir(
    path: str | Path,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    vocab_size: int | None = None,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 512,
    seed: int = 0,
    num_experts: int | None = None,
    experts_per_token: int = 2,
    expert_intermediate: int | None = None,
    family: str = "qwen2",
) -> Path:
    """Save a tiny randomly initialised ``Qwen2ForCausalLM`` plus the byte tokenizer into ``path``;
    ``family="llama"`` gives a ``LlamaForCausalLM``; with ``num_experts`` a ``Qwen3MoeForCausalLM``
    instead (every layer a top-``experts_per_token`` Mixture-of-Experts MLP, router weights drawn so
    that routing has no ties).

    ``vocab_size`` defaults to the tokenizer's length (259). With the defaults the model has about
    0.1M parameters and loads with plain ``AutoModelForCausalLM``/``AutoTokenizer.from_pretrained``.
    """
    import torch
    from transformers import GenerationConfig

    tokenizer = build_byte_tokenizer()
    vocab_size = len(tokenizer) if vocab_size is None else vocab_size
    if vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens")
    if family not in ("qwen2", "llama"):
        raise ValueError(f"family must be qwen2 or llama, got {family!r}")
    config, model_cls = tiny_model_config(
        family, num_experts, dict(
            vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=tie_word_embeddings, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ),
        head_dim=hidden // heads, experts_per_token=experts_per_token,
        expert_intermediate=expert_intermediate or intermediate // 2,
    )  # fmt: skip
    # A private generator keeps the caller's global RNG untouched and the weights a pure function of seed.
    fork_devices: list[int] = []
    with torch.random.fork_rng(devices=fork_devices):
        torch.manual_seed(seed)
        model = model_cls(config)
        if num_experts is not None:
            with torch.no_grad():
                for layer in model.model.layers:
                    layer.mlp.gate.weight.normal_(0.0, 0.5)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
