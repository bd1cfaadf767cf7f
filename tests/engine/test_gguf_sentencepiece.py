"""SentencePiece vocabularies from GGUF metadata (`tokenizer.ggml.model = "llama"`): tokens,
scores, token types and byte fallback, built into a `tokenizers` BPE without sentencepiece.
The ids must be the ones transformers gives when it loads the same file's tokenizer.

Small vocabularies in the shape llama.cpp writes them (Llama 2 / Mistral v0.x: <unk>, <s>,
</s>, 256 byte tokens, U+2581-spelled pieces scored by merge rank; Phi-3: the same vocabulary
with its own normalizer) are written here with gguf's writer; the real Gemma 3 vocabulary is
tested in test_gemma3_270m.py.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from compute.tokenizer.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

CORPUS = (
    "The lighthouse keeper climbed the spiral stairs each evening at dusk, counting the steps "
    "as his father had before him. def mean(values): return total / len(values) hello world"
)
TEXTS = [
    "Hello world",
    "The keeper climbed the stairs at dusk.",
    "  leading spaces,\ttabs\n\nand newlines",
    "unseen wörds: Ünïcödé 日本 🙂",  # byte fallback
    "[INST] inline control tokens [/INST] <|user|>",
    " x",
    "a    b",
    "",
]
# Chat templates of the families whose GGUFs carry such a vocabulary (Mistral v0.x, Llama 2).
TEMPLATES = {
    "mistral": "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% else %}{{ message['content'] + "
    "eos_token }}{% endif %}{% endfor %}",
    "llama2": "{% for message in messages %}{% if message['role'] == 'user' %}{{ bos_token + "
    "'[INST] ' + message['content'].strip() + ' [/INST]' }}{% elif message['role'] == "
    "'assistant' %}{{ ' ' + message['content'].strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}",
}
CHAT = [
    {"role": "user", "content": "Who climbed the stairs?"},
    {"role": "assistant", "content": "The keeper, at dusk."},
    {"role": "user", "content": "How many steps?"},
]
SPACE = "\u2581"


def _vocabulary() -> tuple[list[str], list[float], list[int]]:
    """tokens, scores, types: specials, bytes, single characters, then every prefix of each
    word of CORPUS (so every word is reachable by merges), scored by when it was added."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256  # unknown, control, byte
    tokens += ["[INST]", "[/INST]", "<|user|>"]
    types += [3, 3, 4]  # two control tokens, one user-defined
    pieces: list[str] = []
    for char in sorted(set(CORPUS.replace(" ", SPACE))):
        pieces.append(char)
    for word in CORPUS.split():
        spelled = SPACE + word
        for end in range(2, len(spelled) + 1):
            if spelled[:end] not in pieces:
                pieces.append(spelled[:end])
    for pair in ("th", "he", "er", "st", "in", SPACE * 2, SPACE * 4):
        if pair not in pieces:
            pieces.append(pair)
    scores = [0.0] * len(tokens) + [-float(i) for i in range(len(pieces))]
    return tokens + pieces, scores, types + [1] * len(pieces)


def write_gguf(path: Path, arch: str, template: str | None = None) -> Path:
    tokens, scores, types = _vocabulary()
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(256)
    writer.add_embedding_length(64)
    writer.add_block_count(1)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    if template is not None:
        writer.add_chat_template(template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(("arch", "family"), [("llama", "llama2"), ("llama", "mistral"),
                                              ("phi3", None)])  # fmt: skip
def test_sentencepiece_gguf_tokenizes_as_transformers(tmp_path: Path, arch, family) -> None:
    path = write_gguf(tmp_path / "model.gguf", arch, TEMPLATES.get(family))
    ours = Tokenizer.from_gguf(path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), text
        assert ours.encode(text, add_special_tokens=True) == theirs.encode(text), text
        assert ours.encode_prompt(text) == theirs(text)["input_ids"], text  # BOS first
        ids = ours.encode(text)
        assert ours.decode(ids) == theirs.decode(ids), text
    # byte fallback really ran: characters outside the vocabulary became <0xNN> tokens
    assert any(ours.id_to_token(i).startswith("<0x") for i in ours.encode("日本"))
    assert (ours.bos_token_id, ours.eos_token_ids[0]) == (1, 2)
    if family is not None:
        want = theirs.apply_chat_template(CHAT, add_generation_prompt=False, tokenize=True)
        want = want["input_ids"] if hasattr(want, "keys") else want
        assert ours.encode_chat(CHAT, add_generation_prompt=False) == list(want)


def test_an_unknown_gguf_tokenizer_model_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t5.gguf"
    writer = gguf.GGUFWriter(str(path), "t5")
    writer.add_tokenizer_model("t5")
    writer.add_token_list(["<pad>", "</s>"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"unsupported GGUF tokenizer model 't5'"):
        Tokenizer.from_gguf(path)
