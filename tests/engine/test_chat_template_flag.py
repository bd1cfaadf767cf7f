"""`--chat-template FILE`: an operator's Jinja template in place of the model's own.

Checked before any weight loads (a bad file never costs a model load), applied to the
tokenizer the pipeline, the stop checks and the exported gateway tokenizer all use.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from compute.core.config import CacheConfig, DeviceConfig, EngineConfig
from compute.engine import Engine
from compute.loaders import LoadedModel, ModelLoadError, load_model, with_chat_template
from compute.tokenizer.chat_template import read_chat_template
from tests.engine.test_engine import shared_model
from tests.support.fake_engine import smollm2_tokenizer
from tests.support.tiny_vocab import GEMMA_LIKE_TEMPLATE, gemma_like

# A template unlike SmolLM2's own (ChatML): the rendered text shows which one ran.
BRACKETS = (
    "{% for m in messages %}[{{ m.role }}] {{ m.content }}<|endoftext|>\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def _write(tmp_path: Path, text: str | bytes, name: str = "chat.jinja") -> Path:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def test_a_good_file_reads_back_as_written(tmp_path: Path) -> None:
    assert read_chat_template(_write(tmp_path, BRACKETS)) == BRACKETS


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (None, "No such file"),
        ("", "is empty"),
        (b"\xff\xfe{{ messages }}", "codec can't decode"),
        ("{% for m in messages %}{{ m.content }}", "line 1"),
        ("{{ raise_exception('system message required') }}", "system message required"),
        ("{{ messages[0].content | no_such_filter }}", "no_such_filter"),
    ],
    ids=["missing", "empty", "not-utf8", "unclosed-block", "raises", "unknown-filter"],
)
def test_a_file_that_cannot_serve_a_chat_is_refused_naming_it(
    tmp_path: Path, content: str | bytes | None, says: str
) -> None:
    path = tmp_path / "chat.jinja" if content is None else _write(tmp_path, content)
    with pytest.raises(ValueError, match=says) as error:
        read_chat_template(path)
    assert str(path) in str(error.value)


def test_the_template_replaces_the_models_and_keeps_the_vocabulary() -> None:
    ours = smollm2_tokenizer()
    swapped = ours.with_chat_template(BRACKETS)
    text = swapped.apply_chat_template(CHAT)
    assert text == "[user] What is the capital of France?<|endoftext|>\n[assistant] "
    assert swapped.encode_chat(CHAT) == ours.encode(text)
    assert swapped.eos_token_ids == ours.eos_token_ids == (2,)  # the GGUF's <|im_end|>
    assert ours.chat_template != BRACKETS  # the original is untouched
    assert "tool" not in swapped.chat_roles


def test_the_end_of_turn_token_the_template_writes_stops_generation() -> None:
    vocab = gemma_like()
    loaded = LoadedModel(
        dataclasses.replace(load_model("dummy:tiny").config, eos_token_ids=(1,)),
        {},
        vocab,
        "gemma-like.gguf",
    )
    assert vocab.eos_token_ids == (1,)
    served = with_chat_template(loaded, GEMMA_LIKE_TEMPLATE)
    assert served.tokenizer.eos_token_ids == (1, 4)
    assert served.config.eos_token_ids == (1, 4)  # what the scheduler stops on
    assert served.tokenizer.encode_chat([{"role": "user", "content": "hi"}]) == [
        2,
        3,
        5,
        7,
        4,
        3,
        6,
    ]
    assert loaded.config.eos_token_ids == (1,) and loaded.tokenizer is vocab


def test_the_engine_serves_the_file_and_stops_on_its_tokens(tmp_path: Path) -> None:
    path = _write(tmp_path, BRACKETS)
    engine = Engine(
        EngineConfig(
            chat_template=str(path),
            cache=CacheConfig(block_size=16, num_blocks=64),
            device=DeviceConfig(device="cpu"),
        ),
        loaded=shared_model(),
    )
    assert engine.tokenizer.chat_template == BRACKETS
    assert engine.tokenizer.apply_chat_template(CHAT).startswith("[user] ")
    assert engine.scheduler.eos_token_ids == {2}


def test_a_bad_file_is_refused_before_any_weight_loads(tmp_path: Path, monkeypatch) -> None:
    def load_model(*args, **kwargs):
        raise AssertionError("weights loaded before the template was checked")

    monkeypatch.setattr("compute.engine.load_model", load_model)
    bad = _write(tmp_path, "{% if %}")
    with pytest.raises(ModelLoadError, match="--chat-template") as error:
        Engine(EngineConfig(chat_template=str(bad), device=DeviceConfig(device="cpu")))
    assert str(bad) in str(error.value)


def test_a_model_without_a_tokenizer_is_refused() -> None:
    loaded = load_model("dummy:tiny", progress=False)
    with pytest.raises(ModelLoadError, match="no tokenizer"):
        with_chat_template(loaded, BRACKETS)


@pytest.mark.slow
def test_export_tokenizer_writes_the_files_template(tmp_path: Path) -> None:
    from services.cli import cli

    path = _write(tmp_path, BRACKETS)
    out = tmp_path / "tok"
    assert cli.main(["export-tokenizer", str(out), "--chat-template", str(path)]) == 0
    config = json.loads((out / "tokenizer_config.json").read_text("utf-8"))
    assert config["chat_template"] == BRACKETS


def test_export_tokenizer_refuses_a_bad_file_with_exit_2(tmp_path: Path, capsys) -> None:
    from services.cli import cli

    missing = tmp_path / "nope.jinja"
    assert cli.main(["export-tokenizer", str(tmp_path / "tok"), "--chat-template", str(missing)])
    assert "--chat-template" in capsys.readouterr().err
    assert not (tmp_path / "tok").exists()


@pytest.mark.parametrize("template", [None, GEMMA_LIKE_TEMPLATE], ids=["none", "given"])
def test_serving_a_model_without_a_template_warns_at_start(tmp_path: Path, template) -> None:
    from structlog.testing import capture_logs

    from services.server.server import _export_tokenizer
    from tests.support.fake_engine import FakeEngine

    with capture_logs() as logs:
        _export_tokenizer(FakeEngine(gemma_like(template)), str(tmp_path))
    warned = [e for e in logs if e["log_level"] == "warning" and "--chat-template" in e["event"]]
    assert len(warned) == (1 if template is None else 0)
