"""The byte tokenizer and the tiny model folder: exact round trips through save/AutoTokenizer."""

from __future__ import annotations

import pytest
import torch

from rlite.tokenizer import IM_END, IM_START, PAD_TOKEN, build_byte_tokenizer, build_tiny_model_dir

TEXTS = [
    "12+35=",
    "line one\nline two\n\n",
    "\ttabs  and   spaces ",
    "Tom has 3 apples. How many?",
    "ünïcödé € 漢字 🙂",
    "\r\n\x00\x7f",
    f"a{IM_END}b",
]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "12+35="}]
EXPECTED_CHAT = (
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n12+35=<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_byte_tokenizer()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny"))


def test_vocab_and_special_tokens(tokenizer):
    assert len(tokenizer) == 259
    assert tokenizer.convert_tokens_to_ids([PAD_TOKEN, IM_START, IM_END]) == [256, 257, 258]
    assert tokenizer.pad_token == PAD_TOKEN and tokenizer.pad_token_id == 256
    assert tokenizer.eos_token == IM_END and tokenizer.eos_token_id == 258


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_per_byte_and_exact_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    plain = text.replace(IM_END, "")
    if plain == text:
        assert ids == list(text.encode("utf-8"))
    else:  # the special token is one id, not its bytes
        assert ids.count(tokenizer.eos_token_id) == 1
    assert tokenizer.decode(ids) == text


def test_newline_is_byte_10(tokenizer):
    assert tokenizer.encode("\n", add_special_tokens=False) == [10]
    assert tokenizer.encode("a\nb", add_special_tokens=False) == [97, 10, 98]


def test_chat_template(tokenizer):
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text == EXPECTED_CHAT
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tokenizer.convert_tokens_to_ids(IM_START)
    assert ids.count(tokenizer.eos_token_id) == 2
    assert tokenizer.decode(ids) == text


def _assert_same_tokenizer(original, reloaded):
    assert len(reloaded) == len(original)
    assert reloaded.eos_token_id == original.eos_token_id
    assert reloaded.pad_token_id == original.pad_token_id
    for text in [*TEXTS, "e\u0301", "\n"]:
        ids = original.encode(text, add_special_tokens=False)
        assert reloaded.encode(text, add_special_tokens=False) == ids, repr(text)
        assert reloaded.decode(ids) == original.decode(ids)
    chat = reloaded.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert chat == EXPECTED_CHAT
    assert (
        reloaded(chat, add_special_tokens=False)["input_ids"]
        == original(chat, add_special_tokens=False)["input_ids"]
    )


def test_round_trip_tokenizer_folder(tokenizer, tmp_path):
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(tmp_path)
    _assert_same_tokenizer(tokenizer, AutoTokenizer.from_pretrained(tmp_path))


def test_round_trip_model_folder(tokenizer, model_dir):
    """A qwen2 model folder makes AutoTokenizer rebuild the tokenizer as Qwen2Tokenizer; still identical."""
    from transformers import AutoTokenizer

    _assert_same_tokenizer(tokenizer, AutoTokenizer.from_pretrained(model_dir))


def test_tiny_model_loads_and_runs(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    config = model.config
    assert config.model_type == "qwen2"
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (259, 64, 2)
    assert (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size) == (4, 2, 128)
    assert config.max_position_embeddings == 512
    assert not config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert 50_000 < sum(p.numel() for p in model.parameters()) < 500_000
    assert model.generation_config.eos_token_id == 258
    logits = model(torch.tensor([[257, 49, 50, 258]])).logits
    assert logits.shape == (1, 4, 259)
    assert torch.isfinite(logits).all()


def test_tiny_model_is_a_function_of_its_seed(tmp_path):
    from safetensors.torch import load_file

    state = torch.random.get_rng_state()
    a = load_file(build_tiny_model_dir(tmp_path / "a", layers=1, seed=3) / "model.safetensors")
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's RNG is untouched
    b = load_file(build_tiny_model_dir(tmp_path / "b", layers=1, seed=3) / "model.safetensors")
    c = load_file(build_tiny_model_dir(tmp_path / "c", layers=1, seed=4) / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_vocab_size_smaller_than_tokenizer_is_refused(tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):
        build_tiny_model_dir(tmp_path, vocab_size=100)
