"""A whitespace word vocabulary with Gemma's special tokens, built in memory in a millisecond:
for tests of what a SentencePiece-style vocabulary changes (a BOS before raw text, turn
tokens) without a model file."""

from __future__ import annotations

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import pre_tokenizers
from tokenizers.models import WordLevel

from compute.tokenizer.gguf_vocab import bos_processor as _bos_processor
from compute.tokenizer.tokenizer import Tokenizer

SPECIALS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
WORDS = SPECIALS + ["user", "model", "hi", "there"]
# Gemma's turn format in one line (docs/chat-templates/gemma3.jinja without the system turn).
GEMMA_LIKE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m.role }} {{ m.content }}"
    "<end_of_turn>{% endfor %}{% if add_generation_prompt %}<start_of_turn>model {% endif %}"
)


def gemma_like(chat_template: str | None = None, add_bos: bool = True) -> Tokenizer:
    """The vocabulary (ids: WORDS' order); ``add_bos``: raw text gets <bos> first, as the
    Gemma, Llama 2 and Mistral GGUFs ask; no chat template unless given."""
    hf = HFTokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf.add_special_tokens(SPECIALS)
    if add_bos:
        hf.post_processor = _bos_processor("<bos>", WORDS.index("<bos>"))
    return Tokenizer(hf, bos_token="<bos>", eos_token="<eos>", chat_template=chat_template)
