"""``rlite chat`` and ``rlite generate`` give the model its prompts as training did (the chat
template, the run's system prompt), from a model folder, a run's export or a run's checkpoint."""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from rlite.tasks import make_task
from rlite.tokenizer import build_tiny_model_dir
from rlite.tools.cli import main

REPO = Path(__file__).resolve().parents[2]
WARM_START = REPO / "examples" / "warmstart" / "addition-qwen2-1m"


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def templated(tokenizer, prompt: str, system: str | None = None) -> str:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def accuracy(rows: list[dict]) -> float:
    return sum(row["completion"].strip() == row["answer"] for row in rows) / len(rows)


@pytest.fixture(scope="module")
def held_out(tmp_path_factory) -> Path:
    """64 of the quickstart's held-out addition prompts (never trained on)."""
    _, rows = make_task("addition", 2000, 256, 0, digits=2)
    return write_jsonl(tmp_path_factory.mktemp("prompts") / "held_out.jsonl", rows[:64])


def test_the_warm_start_answers_templated_prompts_and_not_raw_ones(held_out, tmp_path, capsys):
    templated_out, raw_out = tmp_path / "templated.jsonl", tmp_path / "raw.jsonl"
    assert main(["generate", str(WARM_START), "--prompts", str(held_out), "--out", str(templated_out)]) == 0
    assert main(["generate", str(WARM_START), "--prompts", str(held_out), "--out", str(raw_out), "--raw"]) == 0
    with_template, without = read_jsonl(templated_out), read_jsonl(raw_out)
    tokenizer = AutoTokenizer.from_pretrained(WARM_START)
    assert [row["prompt_text"] for row in with_template] == [templated(tokenizer, r["prompt"]) for r in with_template]
    assert [row["prompt_text"] for row in without] == [row["prompt"] for row in without]
    assert all(row["answer"] and row["operands"] for row in with_template)  # the input's columns are kept
    # the model learnt addition inside the template only: outside it, it answers noise
    assert accuracy(with_template) >= 0.3
    assert accuracy(with_template) > accuracy(without) + 0.25


def test_chat_reads_piped_turns_and_replies_as_generate_does(held_out, tmp_path, capsys, monkeypatch):
    prompts = [row["prompt"] for row in read_jsonl(held_out)[:5]]
    out = tmp_path / "out.jsonl"
    assert main(["generate", str(WARM_START), "--prompts", str(held_out), "--out", str(out)]) == 0
    expected = [row["completion"] for row in read_jsonl(out)[:5]]
    capsys.readouterr()
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(prompts[:2]) + "\n\n" + "\n".join(prompts[2:]) + "\n"))
    assert main(["chat", str(WARM_START), "--show-prompt"]) == 0
    printed = capsys.readouterr()
    assert printed.out.splitlines() == expected  # one reply per non-empty line, nothing else on stdout
    assert printed.err.count("<|im_start|>assistant") == 5  # --show-prompt: the templated prompts


def test_multi_turn_chat_shows_the_model_the_earlier_turns(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("1+1=\n2+2=\n"))
    assert main(["chat", str(WARM_START), "--multi-turn", "--show-prompt", "--max-new-tokens", "4"]) == 0
    printed = capsys.readouterr()
    first_reply = printed.out.splitlines()[0]
    second_prompt = printed.err.split("<|im_start|>user\n2+2=")[0]
    assert f"<|im_start|>assistant\n{first_reply}<|im_end|>" in second_prompt


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A tiny run with a system prompt, an exported model and a final checkpoint."""
    tmp = tmp_path_factory.mktemp("run")
    model_dir = build_tiny_model_dir(tmp / "tiny")
    run_dir = tmp / "run"
    config = tmp / "run.yaml"
    config.write_text(f"model: {{path: {model_dir}}}\ndata: {{task: addition, num_train: 32, num_eval: 4, "
                      "system_prompt: Add the numbers.}\n")  # fmt: skip
    assert main([
        "train", str(config), "training.steps=2", "training.eval_every=0", "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=4", "rollout.max_new_tokens=4", "training.micro_batch_size=8", "training.lr=1e-2",
        f"logging.run_dir={run_dir}", "logging.loggers=[jsonl]", "logging.plot=false", "logging.progress_bar=false",
        "checkpoint.resume=never", "checkpoint.save_final=true", "checkpoint.export_hf=true",
    ]) == 0  # fmt: skip
    return run_dir


def test_a_run_folder_gives_its_system_prompt_and_its_checkpoint_equals_its_export(finished_run, held_out,
                                                                                 tmp_path, capsys):  # fmt: skip
    from_export = tmp_path / "export.jsonl"
    assert main(["generate", str(finished_run), "--prompts", str(held_out), "--out", str(from_export)]) == 0
    rows = read_jsonl(from_export)
    tokenizer = AutoTokenizer.from_pretrained(finished_run / "hf_model")
    assert [row["prompt_text"] for row in rows] == [templated(tokenizer, r["prompt"], "Add the numbers.") for r in rows]
    # without the export, the latest checkpoint is loaded: the same weights, the same replies
    shutil.move(finished_run / "hf_model", tmp_path / "moved")
    try:
        from_checkpoint = tmp_path / "checkpoint.jsonl"
        assert main(["generate", str(finished_run), "--prompts", str(held_out), "--out", str(from_checkpoint)]) == 0
    finally:
        shutil.move(tmp_path / "moved", finished_run / "hf_model")
    assert "checkpoints" in capsys.readouterr().err  # says what it loaded
    assert read_jsonl(from_checkpoint) == rows


def test_a_checkpoint_newer_than_the_export_is_loaded(finished_run, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("1+1=\n")
    exported = finished_run / "hf_model" / "config.json"
    written = exported.stat().st_mtime
    os.utime(exported, (written - 3600, written - 3600))  # as if exported before the run was resumed
    try:
        assert main(["generate", str(finished_run), "--prompts", str(prompts), "--out", str(tmp_path / "o.jsonl")]) == 0
    finally:
        os.utime(exported, (written, written))
    assert "checkpoints/step_00000002" in capsys.readouterr().err


def test_samples_of_the_run_carry_the_text_the_model_saw(finished_run):
    tokenizer = AutoTokenizer.from_pretrained(finished_run / "hf_model")
    rows = read_jsonl(finished_run / "samples.jsonl")
    assert {row["kind"] for row in rows} == {"train", "eval"}
    for row in rows:
        assert row["prompt_text"] == templated(tokenizer, row["prompt"], "Add the numbers.")


def test_a_txt_file_gives_one_prompt_per_line(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("22+95=\n\n12+30=\n")
    out = tmp_path / "out.jsonl"
    assert main(["generate", str(WARM_START), "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "3"]) == 0
    assert [row["prompt"] for row in read_jsonl(out)] == ["22+95=", "12+30="]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["chat", "no/such/folder"], "MODEL_OR_RUN 'no/such/folder' is not a folder"),
        (["generate", str(REPO / "configs"), "--prompts", "p.txt", "--out", "o.jsonl"], "--prompts: 'p.txt' not found"),
        (["chat", str(REPO / "configs")], "neither a run folder"),
        (["chat", str(WARM_START), "--temperature", "-1"], "--temperature must be >= 0"),
        (["chat", str(WARM_START), "--raw", "--multi-turn"], "--multi-turn needs the chat template"),
    ],
)
def test_bad_input_exits_2_naming_what_is_wrong(args, message, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_a_bad_prompts_line_is_named(tmp_path, capsys):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1+1="}])
    prompts.write_text(prompts.read_text() + "{not json\n")
    assert main(["generate", str(WARM_START), "--prompts", str(prompts), "--out", str(tmp_path / "o.jsonl")]) == 2
    assert f"{prompts} line 2 is not valid JSON" in capsys.readouterr().err
    write_jsonl(prompts, [{"question": "1+1="}])
    assert main(["generate", str(WARM_START), "--prompts", str(prompts), "--out", str(tmp_path / "o.jsonl")]) == 2
    assert "line 1 has no 'prompt' column (--prompt-key)" in capsys.readouterr().err



# -- the engine: the default engine's registration builds it (its from_model), as for any plugin ------


def transformers_stand_in(from_model=None):
    """A plugin registering ``transformers`` as the built-in does, declaring ``from_model`` only when given."""
    from rlite import hookimpl
    from rlite.plugins.transformers import TransformersEngineConfig, make_transformers_engine

    class StandIn:
        @hookimpl
        def register_rollout_engines(self, register):
            extra = {} if from_model is None else {"from_model": from_model}
            register("transformers", make_transformers_engine, TransformersEngineConfig, **extra)

    return StandIn()


def manager_with(stand_in):
    """The built-in plugins with ``stand_in`` in place of the ``transformers`` engine's."""
    from rlite.plugin_manager import build_plugin_manager

    pm = build_plugin_manager(autoload=False)
    pm.unregister(name="rlite.plugins.transformers")
    pm.register(stand_in, name="stand-in")
    return pm


def test_generate_decodes_with_the_engine_the_default_engines_registration_builds(held_out, tmp_path):
    from rlite.plugin_manager import plugin_manager_in_use
    from rlite.plugins.transformers import engine_from_model

    built = []

    def recording(model, *, pad_token_id, eos_token_ids):
        built.append((pad_token_id, list(eos_token_ids)))
        return engine_from_model(model, pad_token_id=pad_token_id, eos_token_ids=eos_token_ids)

    expected, out = tmp_path / "expected.jsonl", tmp_path / "out.jsonl"
    args = ["generate", str(WARM_START), "--prompts", str(held_out), "--max-new-tokens", "4"]
    assert main([*args, "--out", str(expected)]) == 0
    with plugin_manager_in_use(manager_with(transformers_stand_in(recording))):
        assert main([*args, "--out", str(out)]) == 0
    tokenizer = AutoTokenizer.from_pretrained(WARM_START)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    assert built == [(pad, [tokenizer.eos_token_id])]  # one engine, for the whole file
    assert read_jsonl(out) == read_jsonl(expected)


def test_a_default_engine_without_from_model_is_refused_naming_it(held_out, tmp_path, capsys):
    from rlite.plugin_manager import plugin_manager_in_use

    with plugin_manager_in_use(manager_with(transformers_stand_in())):
        assert main(["generate", str(WARM_START), "--prompts", str(held_out), "--out", str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "the default rollout engine 'transformers' (plugin 'stand-in') declares no from_model" in err

# -- bounds: the model's context and the memory, checked before anything is allocated ---------------


@pytest.fixture
def no_model_loads(monkeypatch):
    """Fails a test that loads a model's weights: a refusal must come before them."""
    from transformers import AutoModelForCausalLM

    def refuse(*args, **kwargs):
        raise AssertionError("the model's weights were loaded before the refusal")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)


def test_max_new_tokens_past_the_context_is_refused_before_the_model_loads(no_model_loads, capsys, monkeypatch):
    """``--max-new-tokens 1000000000`` allocated 256 GB and died after 152 s."""
    monkeypatch.setattr("sys.stdin", io.StringIO("1+1=\n"))
    assert main(["chat", str(WARM_START), "--max-new-tokens", "1000000000"]) == 2
    err = capsys.readouterr().err
    assert "--max-new-tokens 1000000000 + a prompt of 1 tokens" in err and "context of 256 positions" in err
    assert "lower --max-new-tokens to at most 255" in err


def test_a_prompt_longer_than_the_context_is_refused_before_the_model_loads(no_model_loads, tmp_path, capsys):
    """A 600,000-token prompt to a 256-position model was still running after 300 s."""
    prompts = tmp_path / "long.txt"
    prompts.write_text("1" * 600_000 + "+1=\n")
    assert main(["generate", str(WARM_START), "--prompts", str(prompts), "--out", str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "exceed the model's context of 256 positions" in err and "shorten the prompt" in err
    assert not (tmp_path / "o.jsonl").exists() and list(tmp_path.iterdir()) == [prompts]  # no half-written file


def test_a_chat_turn_longer_than_the_context_is_refused(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("1+1=\n" + "2" * 300 + "+1=\n"))
    assert main(["chat", str(WARM_START), "--raw", "--max-new-tokens", "3"]) == 2
    printed = capsys.readouterr()
    assert len(printed.out.splitlines()) == 1  # the first turn was answered
    assert "--max-new-tokens 3 + a prompt of 303 tokens = 306 tokens exceed the model's context of 256" in printed.err


def test_a_decode_bigger_than_the_memory_is_refused_before_the_model_loads(no_model_loads, held_out, tmp_path, capsys,
                                                                          monkeypatch):  # fmt: skip
    monkeypatch.setattr("rlite.run.limits.available_memory", lambda device: (2**20, "MemAvailable in /proc/meminfo"))
    argv = ["generate", str(WARM_START), "--prompts", str(held_out), "--out", str(tmp_path / "o.jsonl")]
    assert main([*argv, "--batch-size", "8"]) == 2
    err = capsys.readouterr().err
    assert "memory: decoding 8 prompt(s) of up to" in err and "the weights and the KV cache" in err
    assert "but 0.00 GiB are available (MemAvailable in /proc/meminfo): lower --max-new-tokens or --batch-size" in err


# -- what chat and generate are given -----------------------------------------------------------------


@pytest.mark.parametrize("temperature", ["nan", "inf"])
def test_a_temperature_that_is_not_a_finite_number_is_refused(capsys, monkeypatch, temperature):
    monkeypatch.setattr("sys.stdin", io.StringIO("1+1=\n"))
    assert main(["chat", str(WARM_START), "--temperature", temperature]) == 2
    assert f"--temperature must be >= 0 and finite (0 is greedy), got {float(temperature)}" in capsys.readouterr().err


@pytest.mark.parametrize(("line", "message"), [(b"1+\xff1=\n", "stdin line 2 is not UTF-8 text (byte 3 of the line"),
                                               (b"1+\x001=\n", "stdin line 2 holds a NUL character")])  # fmt: skip
def test_chat_refuses_a_line_that_is_not_text_naming_it(capsys, monkeypatch, line, message):
    stdin = io.TextIOWrapper(io.BytesIO(b"1+1=\n" + line), encoding="utf-8")  # as a pipe's: bytes underneath
    monkeypatch.setattr("sys.stdin", stdin)
    assert main(["chat", str(WARM_START), "--max-new-tokens", "2"]) == 2
    printed = capsys.readouterr()
    assert message in printed.err and len(printed.out.splitlines()) == 1


@pytest.mark.parametrize(("content", "message"), [(b"1+1=\n2+\xfe2=\n", "line 2 is not UTF-8 text"),
                                                  (b"1+1=\n2+\x002=\n", "line 2 holds a NUL character")])  # fmt: skip
def test_generate_refuses_a_prompt_file_that_is_not_text_naming_the_line(no_model_loads, tmp_path, capsys, content,
                                                                         message):  # fmt: skip
    prompts = tmp_path / "p.txt"
    prompts.write_bytes(content)
    assert main(["generate", str(WARM_START), "--prompts", str(prompts), "--out", str(tmp_path / "o.jsonl")]) == 2
    assert f"--prompts: {prompts} {message}" in capsys.readouterr().err


def test_generate_refuses_an_output_it_cannot_write_before_generating(no_model_loads, held_out, tmp_path, capsys):
    argv = ["generate", str(WARM_START), "--prompts", str(held_out), "--out"]
    assert main([*argv, str(tmp_path)]) == 2  # a folder: it failed after generating every reply
    assert f"--out: {str(tmp_path)!r} is a folder" in capsys.readouterr().err
    assert main([*argv, str(tmp_path / "missing" / "o.jsonl")]) == 2
    assert f"--out: the folder {str(tmp_path / 'missing')!r} does not exist" in capsys.readouterr().err
    before = held_out.read_bytes()
    assert main(["generate", str(WARM_START), "--prompts", str(held_out), "--out", str(held_out)]) == 2
    assert "is the --prompts file; writing the replies would overwrite the prompts" in capsys.readouterr().err
    assert held_out.read_bytes() == before
