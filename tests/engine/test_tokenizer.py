"""Tokenizer and chat template of the embedded GGUF against transformers loading the same file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from compute.loaders.default_model import default_model_path
from compute.tokenizer.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

TEXTS = [
    "Hello, world! How are you today?",
    "   leading spaces, and trailing ones   ",
    "12345 + 678 = 13023; pi is 3.14159",
    'def area(r: float) -> float:\n    return 3.14 * r ** 2  # "circle"\n',
    "emoji 😀🎉👍🏽 and symbols ©®™ → ∞",
    "中文文本，日本語のテキスト，한국어 텍스트",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "tabs\tand\r\nnewlines\n\n\nend",
    "Ünïcödé àccénts; don't won't I'm we'll",
    "a<|endoftext|>b <file_sep> c",
    "",
]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi!"},
    ],
    [
        {"role": "user", "content": "Count to 3."},
        {"role": "assistant", "content": "1, 2, 3."},
        {"role": "user", "content": "Now backwards, with emoji 🚀."},
    ],
    [
        {"role": "system", "content": "Answer in JSON."},
        {"role": "user", "content": "  spaced   "},
        {"role": "assistant", "content": '{"a": 1}'},
    ],
]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def ours(gguf_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_path)


@pytest.fixture(scope="module")
def reference(gguf_path: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name
    )


def test_special_token_metadata(ours: Tokenizer, reference) -> None:
    assert ours.vocab_size == 49152 == len(reference)
    assert ours.bos_token_id == 1 and ours.bos_token == "<|im_start|>"
    assert ours.eos_token == "<|im_end|>" and ours.eos_token_ids == (2,)
    assert ours.encode("<|im_start|><|im_end|>") == [1, 2]
    assert ours.id_to_token(2) == "<|im_end|>"
    assert ours.chat_roles == frozenset({"system", "user", "assistant"})
    with pytest.raises(ValueError):
        ours.id_to_token(10**6)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(ours: Tokenizer, reference, text: str) -> None:
    expected = reference.encode(text, add_special_tokens=False)
    assert ours.encode(text) == expected
    assert ours.encode(text, add_special_tokens=True) == reference.encode(text)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips(ours: Tokenizer, reference, text: str) -> None:
    ids = ours.encode(text)
    assert ours.decode(ids) == text == reference.decode(ids)
    skipped = reference.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=True) == skipped


@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_matches_transformers(
    ours: Tokenizer, reference, chat: list[dict[str, str]], add_generation_prompt: bool
) -> None:
    kwargs = {"add_generation_prompt": add_generation_prompt}
    text = reference.apply_chat_template(chat, tokenize=False, **kwargs)
    ids = reference.apply_chat_template(chat, tokenize=True, return_dict=False, **kwargs)
    assert ours.apply_chat_template(chat, **kwargs) == text
    assert ours.encode_chat(chat, **kwargs) == list(ids)


def test_chat_template_is_sandboxed(ours: Tokenizer) -> None:
    template = "{{ messages.__class__.__mro__ }}"
    hostile = Tokenizer(ours.hf, bos_token=None, eos_token=None, chat_template=template)
    with pytest.raises(Exception, match="unsafe|not safely|attribute"):
        hostile.apply_chat_template(CHATS[0])


def test_raise_exception_in_template(ours: Tokenizer) -> None:
    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    )
    strict = Tokenizer(ours.hf, bos_token=None, eos_token=None, chat_template=template)
    with pytest.raises(Exception, match="user first"):
        strict.apply_chat_template([{"role": "system", "content": "x"}])


def test_from_hf_dir_matches_gguf(ours: Tokenizer, tmp_path: Path) -> None:
    ours.hf.save(str(tmp_path / "tokenizer.json"))
    config = {
        "bos_token": {"content": "<|im_start|>"},
        "eos_token": "<|im_end|>",
        "chat_template": ours.chat_template,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = Tokenizer.from_hf_dir(tmp_path)
    assert loaded.eos_token_ids == ours.eos_token_ids and loaded.bos_token_id == 1
    for text in TEXTS:
        assert loaded.encode(text) == ours.encode(text)
    for chat in CHATS:
        assert loaded.encode_chat(chat) == ours.encode_chat(chat)


def test_hf_dir_template_file_and_tool_role(ours: Tokenizer, tmp_path: Path) -> None:
    ours.hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    template = (
        "{% for m in messages %}{% if m.role == 'tool' %}T{% endif %}"
        "{{ m.content }}<|im_end|>{% endfor %}"
    )
    (tmp_path / "chat_template.jinja").write_text(template)
    loaded = Tokenizer.from_hf_dir(tmp_path)
    assert "tool" in loaded.chat_roles
    rendered = loaded.apply_chat_template([{"role": "tool", "content": "ok"}])
    assert rendered == "Tok<|im_end|>"
    assert loaded.bos_token_id is None and loaded.bos_token == ""
