"""Configuration records: one frozen dataclass per concern, validated once.

CLI flags and HEADRACE_* environment variables map onto these in one place
(services/cli/cli_flags.py). The environment is otherwise read only for what is not engine
configuration: the CPU kernels' build directory and compiler (kernels/cpu/build.py), the
CUDA toolkit's path (kernels/cuda/launch.py), OpenTelemetry's own OTEL_* endpoints
(services/telemetry/tracing_config.py), and the client's credentials (services/cli/cli.py).
"""

from __future__ import annotations

from dataclasses import dataclass

ROPE_TYPES = ("default", "linear", "llama3")
# MLP activations of the gated MLP: silu (SwiGLU, Llama) and tanh-approximated GELU (GeGLU,
# Gemma's gelu_pytorch_tanh).
ACTIVATIONS = ("silu", "gelu_tanh")
LAYER_TYPES = ("full", "sliding")


_POSITIVE_SHAPE = (
    "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
    "head_dim", "max_position_embeddings",
)  # fmt: skip
_OPTIONAL_SCALES = ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap")


def _positive(name: str, value: float) -> None:
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the decoder and the deltas of its family; filled by a loader, read by the model."""

    name: str  # human-readable model name, reported by GetModelInfo
    architecture: str  # e.g. "llama", "qwen2", "mistral"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA when < num_heads)
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096  # the model's trained context length
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2-style biases on q/k/v projections
    qk_norm: bool = False  # Qwen3-style RMSNorm of each q and k head before RoPE
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # RoPE frequencies (compute/models/rope.py): "default"; "linear" (every frequency /
    # rope_factor); "llama3" (Llama 3.1's per-frequency scaling by rope_factor,
    # rope_low_freq_factor, rope_high_freq_factor and rope_original_max_position).
    # rope_freq_factors: the per-frequency divisors a GGUF file stores instead (its
    # rope_freqs tensor), any type.
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    rope_freq_factors: tuple[float, ...] | None = None
    # Tokens a query attends to (itself included) on its sliding layers; None = all. Masked
    # by absolute position in every kernel path (kernels/reference.py, kernels/csrc/cpu).
    sliding_window: int | None = None
    # Mixture of experts (compute/models/moe.py): 0 experts = a dense MLP on every layer. Otherwise
    # each token's MLP is the num_experts_per_tok experts its router scores highest (of
    # num_experts SwiGLU MLPs of moe_intermediate_size), weighted by their softmax
    # probabilities, renormalised to sum to 1 when norm_topk_prob; the layers listed in
    # dense_layers keep a dense MLP of intermediate_size instead (Qwen3-MoE's
    # mlp_only_layers and decoder_sparse_step).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    dense_layers: tuple[int, ...] = ()
    # Each layer's attention, "full" or "sliding" (LAYER_TYPES); None = every layer slides
    # when sliding_window is set (Mistral), Gemma 2/3 alternate.
    layer_types: tuple[str, ...] | None = None
    # RoPE base of the sliding layers (Gemma 3's rope_local_base_freq, default RoPE); None =
    # rope_theta and the model's RoPE type on every layer.
    rope_local_theta: float | None = None
    # Gemma-style deltas: the gated MLP's activation (ACTIVATIONS); embeddings times
    # embed_scale (sqrt(hidden)); RMSNorms of the attention and MLP outputs before the
    # residual add (sandwich_norms: HF post_attention_layernorm / post_feedforward_layernorm,
    # pre_feedforward_layernorm the MLP's input norm); attention scaled by
    # query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5; soft-capping
    # (tanh(x / cap) * cap) of the attention scores and of the final logits.
    hidden_act: str = "silu"
    embed_scale: float = 1.0
    sandwich_norms: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None

    def __post_init__(self) -> None:
        for name in _POSITIVE_SHAPE + ("rope_factor",):
            _positive(name, getattr(self, name))
        for name in ("sliding_window", *_OPTIONAL_SCALES):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        _one_of("rope_type", self.rope_type, ROPE_TYPES)
        _one_of("hidden_act", self.hidden_act, ACTIVATIONS)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        self._check_lists()
        if self.num_experts and not (
            0 < self.num_experts_per_tok <= self.num_experts and self.moe_intermediate_size > 0
        ):
            raise ValueError(
                f"mixture of experts: {self.num_experts_per_tok} experts per token of "
                f"{self.num_experts}, moe_intermediate_size {self.moe_intermediate_size}"
            )

    def _check_lists(self) -> None:
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ValueError(
                f"rope_freq_factors must hold head_dim / 2 = {self.head_dim // 2} values, "
                f"got {len(self.rope_freq_factors)}"
            )
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(
                    f"layer_types must name {self.num_layers} layers, got {len(self.layer_types)}"
                )
            if set(self.layer_types) - set(LAYER_TYPES):
                raise ValueError(f"layer_types must be {' or '.join(LAYER_TYPES)}")

    def layer_window(self, layer: int) -> int | None:
        """The attention window of layer `layer` (tokens, itself included); None = all."""
        if self.sliding_window is None:
            return None
        if self.layer_types is not None and self.layer_types[layer] != "sliding":
            return None
        return self.sliding_window

    @property
    def sliding_layers(self) -> int:
        """How many layers attend within the sliding window."""
        return sum(self.layer_window(i) is not None for i in range(self.num_layers))

    def features(self) -> tuple[str, ...]:
        """Every way this model differs from a plain Llama decoder, one string each, in use
        (GetModelInfo's features)."""
        out = []
        if self.sliding_window is not None:
            out.append(
                f"sliding_window={self.sliding_window} "
                f"({self.sliding_layers} of {self.num_layers} layers)"
            )
        if self.rope_type != "default":
            out.append(f"rope={self.rope_type} (factor {self.rope_factor:g})")
        if self.rope_freq_factors is not None:
            out.append("rope_freq_factors")
        if self.rope_local_theta is not None:
            out.append(f"rope_local_theta={self.rope_local_theta:g}")
        flags = {
            "qkv_bias": self.qkv_bias,
            "qk_norm": self.qk_norm,
            "gelu_tanh_mlp": self.hidden_act == "gelu_tanh",
            "sandwich_norms": self.sandwich_norms,
        }
        out += [name for name, on in flags.items() if on]
        values = {
            "embed_scale": None if self.embed_scale == 1.0 else self.embed_scale,
            "query_pre_attn_scalar": self.query_pre_attn_scalar,
            "attn_logit_softcapping": self.attn_logit_softcap,
            "final_logit_softcapping": self.final_logit_softcap,
        }
        out += [f"{name}={value:g}" for name, value in values.items() if value is not None]
        return tuple(out)

    @property
    def attn_scale(self) -> float:
        """What attention scores are multiplied by before the softmax."""
        if self.query_pre_attn_scalar is not None:
            return self.query_pre_attn_scalar**-0.5
        return self.head_dim**-0.5

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has a mixture-of-experts MLP."""
        return self.num_experts > 0 and layer not in self.dense_layers


# The default CPU KV cache holds this many tokens per running sequence: the short chats a
# CPU serves fit, a longer one preempts others (memory is touched at start, so RSS is what
# the cache really costs; --kv-cache-memory-gib or --num-blocks give more).
CPU_KV_TOKENS_PER_SEQ = 256
# What the KV cache may hold (--kv-cache-dtype): "auto" = the model dtype (fp32 on the CPU:
# the exact paths stay exact), float16 with --weights quantized-int8 (llama.cpp's numerics);
# int8 = per token and head int8 codes that carry their own bf16 scale, head_dim bytes a row
# (CPU only; head_dim a multiple of 16).
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "int8")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache."""

    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # explicit block count; None = derive from memory
    # KV memory budget when num_blocks is None; None = on a GPU what gpu_memory_utilization
    # leaves, on the CPU room for max_num_seqs sequences of CPU_KV_TOKENS_PER_SEQ tokens (at
    # least one full-length).
    memory_gib: float | None = None
    # The fraction of the GPU's memory the engine may fill in all (weights, activations,
    # CUDA graphs, KV cache: the cache gets the rest; compute/runner/kv_sizing.py), as
    # vLLM's --gpu-memory-utilization. Used when num_blocks and memory_gib are unset.
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True  # share full blocks of identical prefixes
    swap_space_gib: float = 1.0  # host memory for swapped-out blocks (preemption_mode=swap)
    # Element type of the cache (KV_CACHE_DTYPES): K/V are rounded to it once when written
    # and widened to fp32 when read; block counts from a memory budget follow its bytes.
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.memory_gib is not None and self.memory_gib <= 0:
            raise ValueError(f"memory_gib must be positive, got {self.memory_gib}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.swap_space_gib < 0:
            raise ValueError(f"swap_space_gib must be >= 0, got {self.swap_space_gib}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype (--kv-cache-dtype) must be one of {', '.join(KV_CACHE_DTYPES)}"
                f", got {self.kv_cache_dtype!r}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    """Iteration-level scheduling policy."""

    max_num_seqs: int = 64  # cap on sequences running in one step
    max_num_batched_tokens: int = 2048  # token budget of one step (decodes + prefill chunks)
    max_model_len: int | None = None  # prompt + output cap; None = the model's context
    preemption_mode: str = "recompute"  # "recompute" or "swap" when blocks run out
    # At most this many consecutive steps may run prefill chunks while decodes wait
    # for their share of the budget; 0 = no limit (decodes always go first anyway).
    prefill_interval: int = 0
    policy: str = "fcfs"  # "fcfs" or "priority" (lower priority value runs first)
    # KV blocks kept free for running decodes to grow into: prefill chunks of all but the
    # oldest request, swap-ins and admissions leave them; None = one per sequence
    # (max_num_seqs), at most a tenth of the cache.
    watermark_blocks: int | None = None
    # A step-time target: prefill chunks are cut so that a step's estimated time (fitted
    # online from the steps run: compute/core/step_cost.py) stays within it, so running
    # streams wait at most about this long between tokens while long prompts are prefilled;
    # None = no target (chunks up to max_num_batched_tokens).
    max_step_ms: float | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(
                f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(
                f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}"
            )
        if self.prefill_interval < 0:
            raise ValueError(f"prefill_interval must be >= 0, got {self.prefill_interval}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.watermark_blocks is not None and self.watermark_blocks < 0:
            raise ValueError(f"watermark_blocks must be >= 0, got {self.watermark_blocks}")
        if self.max_step_ms is not None and not self.max_step_ms > 0:
            raise ValueError(f"max_step_ms must be positive, got {self.max_step_ms}")

    def watermark(self, num_blocks: int) -> int:
        """The watermark in blocks for a cache of ``num_blocks``."""
        if self.watermark_blocks is not None:
            return min(self.watermark_blocks, num_blocks)
        return min(self.max_num_seqs, num_blocks // 10)


SPECULATIVE_METHODS = ("none", "ngram")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: drafts guessed from the sequence itself, verified in one step.

    "ngram" (prompt lookup): the longest recent earlier occurrence of the sequence's last
    n tokens (n from ngram_max down to ngram_min, in prompt + output) proposes the up to
    num_tokens tokens that followed it, at most 2n - 1 of them (a one-token match risks
    one draft token, a longer one the whole draft: compute/core/ngram.py); the step scores
    the sequence's last token and the draft together, and the sampler keeps the longest
    prefix the model agrees with plus one token of its own (compute/sampling/sampler.py). Output
    is the same as without it (greedy: token for token; sampling: in distribution).
    Drafts are only made while at most max_batch sequences run, never for requests with
    penalties, and only with synchronous output (compute/engine.py).
    """

    method: str = "none"  # "none" or "ngram"
    num_tokens: int = 4  # K: draft tokens per step and sequence
    ngram_min: int = 1  # shortest suffix match that makes a draft
    ngram_max: int = 5  # longest suffix match tried (first)
    max_batch: int = 8  # no drafts in a step while more sequences than this run

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                f"got {self.method!r}"
            )
        if self.num_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                "speculative n-gram lengths need 1 <= min <= max, got "
                f"min {self.ngram_min}, max {self.ngram_max}"
            )
        if self.max_batch < 1:
            raise ValueError(f"speculative_max_batch must be >= 1, got {self.max_batch}")

    @property
    def enabled(self) -> bool:
        return self.method != "none"


WEIGHT_MODES = ("auto", "dense", "quantized", "quantized-int8")


@dataclass(frozen=True)
class DeviceConfig:
    """Where and in what precision the model runs."""

    device: str = "auto"  # "auto" (cuda when available), "cpu", "cuda", "cuda:N"
    dtype: str = "auto"  # "auto" (fp32 on CPU, bf16 on GPU), "float32", "float16", "bfloat16"
    # CPU threads (torch and the CPU kernels); None = the CPUs this process may use
    # (affinity mask, cgroup quota; compute/device/threads.py), at most torch's default
    num_threads: int | None = None
    # Decode steps replayed from CUDA graphs, one per bucketed batch size (compute/
    # cuda_graphs.py). None = on for CUDA, eager (an error logged) if the capture fails;
    # True = on, a failed capture fails the engine; ignored on the CPU (with a log line).
    cuda_graphs: bool | None = None
    # Schedule and launch step N+1 before step N's sampled ids reach the host, so the GPU
    # never waits for Python between steps (compute/engine.py); outputs come one step
    # later. None = on for CUDA, off on the CPU (where a step's work is done when its
    # launch returns, so there is nothing to overlap).
    async_output: bool | None = None
    # CPU steps on the compiled CPU kernels ("native", fp32 only) or torch ("torch");
    # "auto" = native when they build on this machine and the dtype is fp32.
    cpu_kernels: str = "auto"
    # "dense" dequantizes a GGUF model to --dtype at load (the reference numerics); "quantized"
    # keeps its Q4_0/Q4_1/Q8_0/Q5_x/K-quant matrices in their blocks (CPU kernels, ~5x less
    # memory, weights bit-identical, fp32 math); "quantized-int8" also quantizes activations to
    # int8 per 32 values, as llama.cpp does (fastest, approximate); "auto" = quantized when the
    # CPU kernels run, dense otherwise.
    weights: str = "auto"

    def __post_init__(self) -> None:
        if self.cpu_kernels not in ("auto", "native", "torch"):
            raise ValueError(f"cpu_kernels must be auto, native or torch, got {self.cpu_kernels!r}")
        if self.weights not in WEIGHT_MODES:
            raise ValueError(
                f"weights must be one of {', '.join(WEIGHT_MODES)}, got {self.weights!r}"
            )
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(
                f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}"
            )
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, grouped by concern."""

    model: str = "default"  # "default", a .gguf path, an HF directory, or "dummy:<shape>"
    seed: int = 0  # seed of the global generator (unseeded requests) and dummy weights
    chat_template: str = ""  # a Jinja file replacing the model's chat template ("" = its own)
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    device: DeviceConfig = DeviceConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
