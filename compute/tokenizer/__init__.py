"""The tokenizer: text <-> ids, GGUF vocabularies rebuilt for `tokenizers`, chat templates."""
