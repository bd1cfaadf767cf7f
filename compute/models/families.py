"""Model families: one record per architecture headrace serves, its deltas held as data.

A family is named by Hugging Face's ``model_type`` (config.json) and by llama.cpp's
``general.architecture`` (GGUF). Its record says how it differs from a plain Llama decoder:
the loaders (compute/loaders/hf.py, gguf.py) and the GGUF vocabulary rebuild
(compute/tokenizer/gguf_vocab.py) look it up once and read its fields, and no other module
compares architecture names. What the deltas do at run time is ModelConfig's
(compute/core/config.py) and the decoder's (compute/models/decoder.py).
docs/models.md lists every record (tests/core/test_families.py checks it);
docs/development.md ("Adding a model family") says what a new one touches. Pure data: no torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# Which layers slide when a checkpoint sets a sliding window (Family.window_layers).
OPT_IN = "opt-in"  # Qwen2/3: only with use_sliding_window, from layer max_window_layers on
EVERY_LAYER = "every-layer"  # Mistral, Phi-3, Mixtral: every layer whenever it is set
PATTERN = "pattern"  # Gemma: sliding and full layers alternate (Family.swa_pattern)
WINDOW_LAYERS = (OPT_IN, EVERY_LAYER, PATTERN)

# How a GGUF SentencePiece vocabulary is rebuilt (Family.sentencepiece), as transformers'
# gguf_tokenizer_mapping builds it.
METASPACE = "metaspace"  # LlamaTokenizer: a Metaspace pre-tokenizer adds the prefix space
NORMALIZER_PREFIX = "normalizer-prefix"  # Phi-3: a normalizer adds the prefix space
GEMMA_VOCAB = "gemma"  # GemmaTokenizer: spaces respelled, merges in token order, no prefix space
SENTENCEPIECE_STYLES = (METASPACE, NORMALIZER_PREFIX, GEMMA_VOCAB)
# GGUF architectures headrace does not load whose SentencePiece vocabulary it still reads
# (Tokenizer.from_gguf takes any file): Gemma 1 spells its vocabulary as Gemma 2 and 3 do.
_VOCABULARY_ONLY = {"gemma": GEMMA_VOCAB}


@dataclass(frozen=True)
class Experts:
    """How a config.json describes a family's mixture of experts (compute/models/moe.py)."""

    width_key: str  # the key holding each expert's MLP width
    norm_key: str | None  # the key saying whether top-k weights renormalise; None: always
    sparse_step: bool  # mlp_only_layers / decoder_sparse_step keep some layers dense


@dataclass(frozen=True)
class Family:
    """One architecture: its names in either format and its deltas from a Llama decoder."""

    name: str  # as docs/models.md names it
    hf_model_type: str | None  # config.json's model_type; None: no checkpoint loads as it
    hf_class: str | None  # the CausalLM class transformers builds (config.json architectures)
    gguf_architecture: str | None  # GGUF general.architecture; None: no file loads as it
    # Attention.
    qkv_bias: bool = False  # biases on the q/k/v projections (GGUF: read from its tensors)
    qk_norm: bool = False  # RMSNorm of each q and k head before RoPE (GGUF: from its tensors)
    window_layers: str = OPT_IN  # WINDOW_LAYERS: which layers a sliding window applies to
    swa_pattern: int | None = None  # PATTERN's default n: layer i slides when i % n < n - 1
    hf_pattern_keys: tuple[str, ...] = ()  # config.json keys that override it (transformers 4.x)
    local_rope_base: float | None = None  # sliding layers' own RoPE base (the default when unset)
    query_pre_attn_scalar: bool = False  # scores scaled by config.json's query_pre_attn_scalar
    # llama.cpp scales by (hidden / heads) ** -0.5 instead of head_dim ** -0.5 on models of this
    # many layers (Gemma's 27B), which it recognises by their layer count.
    gguf_scalar_layers: int | None = None
    logit_softcaps: bool = False  # attention-logit and final-logit soft-caps, when set
    # Embeddings, norms, MLP.
    embed_scale: bool = False  # embeddings times sqrt(hidden)
    # RMSNorms scale by (1 + w): folded into w at load (GGUF: by llama.cpp's converter).
    norm_plus_one: bool = False
    sandwich_norms: bool = False  # norms of the attention and MLP outputs too (GGUF: own names)
    activations: tuple[str, ...] = ("silu",)  # ModelConfig.hidden_act values; the first is GGUF's
    activation_key: str = "hidden_act"  # config.json's key; the other spelling is an alias
    experts: Experts | None = None  # a mixture of experts when the checkpoint has experts
    # Tensors.
    permuted_qk: bool = False  # llama.cpp's converter permuted Q/K rows for its RoPE layout
    fused_projections: bool = False  # q|k|v and gate|up stored fused (GGUF ffn_up: gate|up)
    # (old, new) parts of a checkpoint's tensor names, replaced in order: its names as the
    # ones every loader gives (compute/loaders/base.py).
    hf_renames: tuple[tuple[str, str], ...] = ()
    sentencepiece: str = METASPACE  # SENTENCEPIECE_STYLES: how a GGUF vocabulary is rebuilt

    def __post_init__(self) -> None:
        if self.window_layers not in WINDOW_LAYERS:
            raise ValueError(f"{self.name}: window_layers {self.window_layers!r}")
        if (self.window_layers == PATTERN) != (self.swa_pattern is not None):
            raise ValueError(f"{self.name}: swa_pattern goes with window_layers={PATTERN!r}")
        if self.sentencepiece not in SENTENCEPIECE_STYLES:
            raise ValueError(f"{self.name}: sentencepiece {self.sentencepiece!r}")


_GEMMA = {
    "window_layers": PATTERN,
    "query_pre_attn_scalar": True,
    "logit_softcaps": True,
    "embed_scale": True,
    "norm_plus_one": True,
    "sandwich_norms": True,
    "activations": ("gelu_tanh", "silu"),  # GeGLU (gelu_pytorch_tanh); SiLU accepted too
    "activation_key": "hidden_activation",
    "sentencepiece": GEMMA_VOCAB,
}

# In the order the loaders list them when refusing an architecture.
FAMILIES = (
    Family("Llama", "llama", "LlamaForCausalLM", "llama", permuted_qk=True),
    Family(
        "Mistral",
        "mistral",
        "MistralForCausalLM",
        "mistral",
        window_layers=EVERY_LAYER,
        permuted_qk=True,
    ),
    Family("Qwen2", "qwen2", "Qwen2ForCausalLM", "qwen2", qkv_bias=True),
    Family("Qwen3", "qwen3", "Qwen3ForCausalLM", "qwen3", qk_norm=True),
    Family(
        "Phi-3",
        "phi3",
        "Phi3ForCausalLM",
        "phi3",
        window_layers=EVERY_LAYER,
        fused_projections=True,
        sentencepiece=NORMALIZER_PREFIX,
    ),
    Family(
        "Qwen3-MoE",
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        "qwen3moe",
        qk_norm=True,
        experts=Experts("moe_intermediate_size", "norm_topk_prob", sparse_step=True),
    ),
    # llama.cpp writes Mixtral as `llama` with expert tensors: the Llama record reads it.
    Family(
        "Mixtral",
        "mixtral",
        "MixtralForCausalLM",
        None,
        window_layers=EVERY_LAYER,
        experts=Experts("intermediate_size", None, sparse_step=False),
        hf_renames=(
            (".block_sparse_moe.gate.", ".mlp.gate."),
            (".block_sparse_moe.experts.", ".mlp.experts."),
            (".w1.weight", ".gate_proj.weight"),
            (".w3.weight", ".up_proj.weight"),
            (".w2.weight", ".down_proj.weight"),
        ),
    ),
    Family(
        "Gemma 2",
        "gemma2",
        "Gemma2ForCausalLM",
        "gemma2",
        swa_pattern=2,
        gguf_scalar_layers=46,
        **_GEMMA,
    ),
    Family(
        "Gemma 3",
        "gemma3_text",
        "Gemma3ForCausalLM",
        "gemma3",
        qk_norm=True,
        swa_pattern=6,
        hf_pattern_keys=("sliding_window_pattern", "_sliding_window_pattern"),
        local_rope_base=10000.0,
        gguf_scalar_layers=62,
        **_GEMMA,
    ),
)
_BY_HF = {f.hf_model_type: f for f in FAMILIES if f.hf_model_type is not None}
_BY_HF_CLASS = {f.hf_class: f for f in FAMILIES if f.hf_class is not None}
_BY_GGUF = {f.gguf_architecture: f for f in FAMILIES if f.gguf_architecture is not None}


def _unsupported(name: str | None, supported: Iterable[str]) -> ValueError:
    return ValueError(f"unsupported architecture {name!r} (supported: {', '.join(supported)})")


def hf_family(model_type: str | None, classes: Iterable[str] = ()) -> Family:
    """The family of a config.json's model_type or, when it has none, of the first class of
    its ``architectures`` transformers knows; ValueError naming the supported ones."""
    if model_type is None:
        model_type = next(
            (_BY_HF_CLASS[c].hf_model_type for c in classes if c in _BY_HF_CLASS), None
        )
    if model_type not in _BY_HF:
        raise _unsupported(model_type, _BY_HF)
    return _BY_HF[model_type]


def gguf_family(architecture: str | None) -> Family:
    """The family of a GGUF file's general.architecture; ValueError naming the supported ones."""
    if architecture not in _BY_GGUF:
        raise _unsupported(architecture, _BY_GGUF)
    return _BY_GGUF[architecture]


def gguf_sentencepiece(architecture: str | None) -> str:
    """How a GGUF file of this general.architecture spells a SentencePiece vocabulary
    (SENTENCEPIECE_STYLES); any architecture, loadable or not: METASPACE unless known."""
    if architecture in _BY_GGUF:
        return _BY_GGUF[architecture].sentencepiece
    return _VOCABULARY_ONLY.get(architecture or "", METASPACE)
