"""The flag table: every serving knob as ``--flag`` and ``HEADRACE_*`` environment twin.

``FLAGS`` is the one table mapping both onto the frozen config dataclasses
(precedence: flag, then environment, then the dataclass default); ``add_flags`` puts
a subset on an argparse parser and ``build_configs`` turns the parsed flags back
into the configs. services/cli/cli.py wires the parsers and runs the subcommands.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from compute.core.config import (
    KV_CACHE_DTYPES,
    WEIGHT_MODES,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from services.api.input_limits import InputLimits
from services.pipeline.pipeline import PipelineConfig
from services.security.security_config import SecurityConfig
from services.server.connection_config import ConnectionConfig
from services.server.server_config import ServerConfig
from services.telemetry.log import FORMATS, LEVELS, LogConfig
from services.telemetry.tracing_config import TracingConfig

ENV_PREFIX = "HEADRACE_"


@dataclass(frozen=True)
class Flag:
    """One knob: ``--option`` and ``HEADRACE_OPTION`` set ``section.field``."""

    option: str
    target: str  # "<section>.<field>", sections as in sections()
    help: str
    type: Callable[[str], Any] = str
    choices: tuple[str, ...] | None = None

    @property
    def dest(self) -> str:
        return self.option.removeprefix("--").replace("-", "_")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.dest.upper()


def _optional_int(text: str) -> int | None:
    return None if text.lower() in ("", "none", "auto") else int(text)


def _optional_float(text: str) -> float | None:
    return None if text.lower() in ("", "none", "auto") else float(text)


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true/false, got {text!r}")


def _auto_bool(text: str) -> bool | None:
    """A switch whose unset value (None, "auto") lets the program choose."""
    return None if text.strip().lower() in ("", "auto", "none") else _bool(text)


FLAGS: tuple[Flag, ...] = (
    Flag("--host", "server.host", "interface the gRPC and metrics servers listen on"),
    Flag("--port", "server.port", "gRPC port (0 = any free port)", int),
    Flag("--metrics-port", "server.metrics_port", "Prometheus /metrics port (-1 = off)", int),
    Flag("--max-message-bytes", "server.max_message_bytes", "largest gRPC message", int),
    Flag("--grace-period", "server.grace_period", "seconds to finish streams on SIGTERM", float),
    Flag("--max-connection-age", "server.max_connection_age",
         "GOAWAY connections this old, to rebalance (0 = never)", float),
    Flag("--max-connection-age-grace", "server.max_connection_age_grace",
         "seconds streams get after that GOAWAY", float),
    Flag("--max-batch-requests", "server.max_batch_requests", "most requests per batch call", int),
    Flag("--tokenizer-dir", "server.tokenizer_dir",
         "where to write the tokenizer that gateways load (empty = a temporary directory)"),
    Flag("--cache-isolation", "server.cache_isolation",
         "whose prefix cache a request runs in: none = shared (a request's cache_salt, or "
         "the worker protocol's x-cache-salt metadata, opts out), token = the caller's "
         "bearer token's alone, so tenants never see each other's cached prompts (needs "
         "--auth-token-file)", choices=("none", "token")),
    Flag("--kv-events", "server.kv_events",
         "stream the prefix cache's stored and evicted blocks and the engine's load to "
         "gateways (worker protocol SubscribeKvEvents: SMG's event-driven cache-aware "
         "routing, pushed load, wedge detection); off = UNIMPLEMENTED", _bool),
    Flag("--profile-dir", "server.profile_dir",
         "directory where the worker protocol's StartProfile/StopProfile write profiles of "
         "the step loop and stages (sampled thread stacks); empty = profiling refused"),
    Flag("--max-connection-idle", "connection.max_connection_idle",
         "GOAWAY connections with no call open this long (0 = never)", float),
    Flag("--keepalive-time", "connection.keepalive_time",
         "seconds of silence before the server pings a connection", float),
    Flag("--keepalive-timeout", "connection.keepalive_timeout",
         "seconds to wait for that ping's ack before closing the connection", float),
    Flag("--handshake-timeout", "connection.handshake_timeout",
         "seconds a new connection gets to finish TLS and HTTP/2 set-up", float),
    Flag("--max-metadata-bytes", "connection.max_metadata_bytes",
         "largest request metadata (headers), else RESOURCE_EXHAUSTED", int),
    Flag("--tls-cert", "security.tls_cert", "PEM certificate chain: serve TLS (gRPC and HTTP)"),
    Flag("--tls-key", "security.tls_key", "PEM private key of --tls-cert"),
    Flag("--tls-client-ca", "security.tls_client_ca",
         "PEM CA bundle: require gRPC clients to present a certificate it signed (mTLS)"),
    Flag("--auth-token-file", "security.auth_token_file",
         "bearer tokens accepted, one per line, re-read on change: require "
         "'authorization: Bearer <token>' (health stays open)"),
    Flag("--auth-reflection", "security.auth_reflection",
         "server reflection needs the token too (with --auth-token-file)", _bool),
    Flag("--auth-metrics", "security.auth_metrics",
         "HTTP /metrics needs the token too (/health stays open)", _bool),
    Flag("--max-request-bytes", "limits.max_request_bytes", "largest request (a batch: whole)",
         int),
    Flag("--max-prompt-bytes", "limits.max_prompt_bytes", "largest prompt, UTF-8 bytes", int),
    Flag("--max-chat-messages", "limits.max_chat_messages", "most messages in a chat", int),
    Flag("--max-chat-bytes", "limits.max_chat_bytes", "largest chat, roles + contents", int),
    Flag("--max-stop-strings", "limits.max_stop_strings", "most stop strings (<= 64)", int),
    Flag("--max-stop-string-chars", "limits.max_stop_string_chars",
         "longest stop string (<= 256)", int),
    Flag("--model", "engine.model", '"default" (SmolLM2), a .gguf, an HF dir or "dummy:<shape>"'),
    Flag("--seed", "engine.seed", "seed of the global generator and of dummy weights", int),
    Flag("--chat-template", "engine.chat_template",
         "a Jinja chat template file used instead of the model's own (a GGUF that carries "
         "none, or one to fix); checked at load, exported to gateways with the tokenizer "
         "(empty = the model's own)"),
    Flag("--device", "device.device", "auto, cpu, cuda or cuda:N"),
    Flag("--dtype", "device.dtype", "precision",
         choices=("auto", "float32", "float16", "bfloat16")),
    Flag("--threads", "device.num_threads",
         "CPU threads (none = the CPUs this process may use: affinity mask, cgroup CPU "
         "quota; replicas sharing a host: cores / replicas each)", _optional_int),
    Flag("--cuda-graphs", "device.cuda_graphs",
         "replay decode steps from CUDA graphs captured at start-up, one per batch size "
         "1, 2, 4, ... max-num-seqs (auto: on for CUDA, eager if the capture fails; true: "
         "a failed capture stops start-up; ignored on the CPU)", _auto_bool),
    Flag("--async-output", "device.async_output",
         "launch each step before the previous one's sampled ids reach the host, so the "
         "GPU does not idle between steps (auto: on for CUDA, off on the CPU)", _auto_bool),
    Flag("--cpu-kernels", "device.cpu_kernels",
         "CPU steps on the compiled kernels (native, fp32) or torch; auto = native if they build",
         choices=("auto", "native", "torch")),
    Flag("--weights", "device.weights",
         "GGUF weights: dense (dequantized at load), quantized (kept in blocks, fp32 math), "
         "quantized-int8 (blocks and int8 activations, llama.cpp's numerics: faster, "
         "approximate); auto = quantized on the CPU kernels", choices=WEIGHT_MODES),
    Flag("--block-size", "cache.block_size", "tokens per KV block (power of two)", int),
    Flag("--num-blocks", "cache.num_blocks", "KV blocks (none = from memory)", _optional_int),
    Flag("--kv-cache-memory-gib", "cache.memory_gib",
         "KV memory if --num-blocks unset (auto: on a GPU what --gpu-memory-utilization "
         "leaves; CPU 256 tokens per --max-num-seqs)", _optional_float),
    Flag("--gpu-memory-utilization", "cache.gpu_memory_utilization",
         "fraction of the GPU's memory the engine may fill (weights, activations, CUDA "
         "graphs and KV cache; the KV cache gets the rest), as vLLM's; used when neither "
         "--num-blocks nor --kv-cache-memory-gib is set; start-up fails, naming both "
         "figures, when the rest cannot hold one --max-model-len sequence", float),
    Flag("--kv-cache-dtype", "cache.kv_cache_dtype",
         "KV cache element type: K/V rounded to it once when written, read back as fp32 "
         "(float16/bfloat16 halve the bytes a long-context decode step reads and double the "
         "sequences per GiB; int8, per token and head scaled, 4x, head_dim a multiple of 16; "
         "docs/architecture.md: numerics table); auto = the model dtype (fp32 on the CPU, "
         "exact), float16 with --weights quantized-int8; on CUDA only the model dtype",
         choices=KV_CACHE_DTYPES),
    Flag("--prefix-caching", "cache.enable_prefix_caching", "share KV of common prefixes", _bool),
    Flag("--swap-space-gib", "cache.swap_space_gib", "host memory for swapped KV blocks", float),
    Flag("--max-num-seqs", "scheduler.max_num_seqs", "most sequences running in one step", int),
    Flag("--max-num-batched-tokens", "scheduler.max_num_batched_tokens", "step token budget", int),
    Flag("--max-model-len", "scheduler.max_model_len", "prompt + output cap", _optional_int),
    Flag("--preemption-mode", "scheduler.preemption_mode", "when KV blocks run out",
         choices=("recompute", "swap")),
    Flag("--prefill-interval", "scheduler.prefill_interval", "most prefill steps in a row", int),
    Flag("--kv-watermark-blocks", "scheduler.watermark_blocks",
         "KV blocks kept free for running decodes to grow into: admissions, swap-ins and the "
         "chunks of all but the oldest prompt leave them (unset: one per --max-num-seqs, at "
         "most a tenth of the cache)", _optional_int),
    Flag("--max-step-ms", "scheduler.max_step_ms",
         "step-time target in ms: prefill chunks are cut so a step's estimated time (fitted "
         "to the steps run, attention over each chunk's context included) stays within it, "
         "bounding the time between tokens of running streams while long prompts prefill "
         "(unset: chunks up to --max-num-batched-tokens)", _optional_float),
    Flag("--policy", "scheduler.policy", "scheduling order", choices=("fcfs", "priority")),
    Flag("--speculative-method", "speculative.method",
         "speculative decoding: ngram = draft tokens looked up in the prompt and output "
         "(the latest earlier match of the last n tokens), verified in one step; same "
         "tokens, faster when the output copies the input; needs synchronous output "
         "(auto async output turns off; --async-output with it is an error)",
         choices=("none", "ngram")),
    Flag("--num-speculative-tokens", "speculative.num_tokens",
         "draft tokens per sequence and step (K: a step scores 1 + K tokens)", int),
    Flag("--speculative-ngram-min", "speculative.ngram_min",
         "shortest match of the sequence's last tokens that makes a draft", int),
    Flag("--speculative-ngram-max", "speculative.ngram_max",
         "longest match tried first (then shorter, down to the min)", int),
    Flag("--speculative-max-batch", "speculative.max_batch",
         "no drafts in a step while more sequences than this run (verification work "
         "that is rejected costs more than it saves in large batches)", int),
    Flag("--max-pending", "pipeline.max_pending", "requests in flight, then rejected", int),
    Flag("--tokenize-workers", "pipeline.tokenize_workers", "tokenizer threads (stage 1)", int),
    Flag("--output-workers", "pipeline.output_workers", "detokenizer threads (stage 3)", int),
    Flag("--max-n", "pipeline.max_n",
         "most samples (n) one request may ask for; each sample counts in --max-pending", int),
    Flag("--grammar-workers", "pipeline.grammar_workers",
         "threads compiling grammar constraints (stage 1, beside the tokenizer's)", int),
    Flag("--grammar-timeout", "pipeline.grammar_timeout_s",
         "seconds a constraint may take to compile before its request fails", float),
    Flag("--grammar-cache-size", "pipeline.grammar_cache_size",
         "compiled constraints kept, by their text", int),
    Flag("--log-level", "log.level", "log level", choices=LEVELS),
    Flag("--log-format", "log.format", "json, console or auto (console on a TTY)", choices=FORMATS),
    Flag("--otlp-endpoint", "tracing.otlp_endpoint",
         "OpenTelemetry: send spans over OTLP/gRPC to this collector, http://HOST:4317 or "
         "https://... (empty = off, unless OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT is set; "
         "needs headrace[tracing])"),
)  # fmt: skip
# The subset that `generate --offline` uses to build its in-process engine.
OFFLINE_FLAGS = ("--model", "--chat-template", "--device", "--dtype", "--threads",
                 "--cpu-kernels", "--weights", "--num-blocks", "--kv-cache-memory-gib",
                 "--gpu-memory-utilization", "--kv-cache-dtype", "--max-model-len")  # fmt: skip


def sections() -> dict[str, type]:
    """Config dataclass of each FLAGS section."""
    return {
        "server": ServerConfig,
        "limits": InputLimits,
        "connection": ConnectionConfig,
        "security": SecurityConfig,
        "engine": EngineConfig,
        "device": DeviceConfig,
        "cache": CacheConfig,
        "scheduler": SchedulerConfig,
        "speculative": SpeculativeConfig,
        "pipeline": PipelineConfig,
        "log": LogConfig,
        "tracing": TracingConfig,
    }


@dataclass(frozen=True)
class Configs:
    engine: EngineConfig
    pipeline: PipelineConfig
    server: ServerConfig
    log: LogConfig
    tracing: TracingConfig = TracingConfig()


def build_configs(args: argparse.Namespace, options: Iterable[str] | None = None) -> Configs:
    """The frozen configs from parsed flags (flags a subcommand lacks keep their defaults).

    ``options``: the only flags to read (``generate --offline`` reads OFFLINE_FLAGS: its
    request flags share dests with engine flags, e.g. its per-request ``--seed``)."""
    classes = sections()
    values: dict[str, dict[str, Any]] = {name: {} for name in classes}
    wanted = None if options is None else set(options)
    for flag in FLAGS:
        if (wanted is None or flag.option in wanted) and hasattr(args, flag.dest):
            section, field = flag.target.split(".")
            values[section][field] = getattr(args, flag.dest)
    nested = ("engine", "server")  # built below, around the sections they hold
    built = {name: cls(**values[name]) for name, cls in classes.items() if name not in nested}
    built["server"] = ServerConfig(
        **values["server"],
        limits=built["limits"],
        connection=built["connection"],
        security=built["security"],
    )
    engine = EngineConfig(
        **values["engine"],
        cache=built["cache"],
        scheduler=built["scheduler"],
        device=built["device"],
        speculative=built["speculative"],
    )
    return Configs(engine, built["pipeline"], built["server"], built["log"], built["tracing"])


def _default(flag: Flag, classes: Mapping[str, type]) -> Any:
    section, field = flag.target.split(".")
    return next(f.default for f in dataclasses.fields(classes[section]) if f.name == field)


def add_flags(
    parser: argparse.ArgumentParser,
    flags: Iterable[Flag],
    environ: Mapping[str, str],
    classes: Mapping[str, type],
    title: str | None = None,
) -> None:
    """Add ``flags``; each default is its env twin's value, else the dataclass default."""
    group = parser.add_argument_group(title) if title else parser
    for flag in flags:
        default = _default(flag, classes)
        kwargs: dict[str, Any] = {
            "help": f"{flag.help} [env {flag.env}; default: {_shown(default, flag)}]"
        }
        if flag.type in (_bool, _auto_bool):
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs.update(type=flag.type, choices=flag.choices)
            if not flag.choices:
                kwargs["metavar"] = flag.dest.upper()
        if flag.env in environ:
            try:
                default = _from_env(flag, environ[flag.env])
            except ValueError as exc:
                parser.error(f"{flag.env}={environ[flag.env]!r}: {exc}")
        group.add_argument(flag.option, default=default, **kwargs)


def _shown(default: Any, flag: Flag | None = None) -> str:
    if isinstance(default, bool):
        return "on" if default else "off"
    if flag is not None and flag.type is _auto_bool and default is None:
        return "auto"
    return "none" if default is None or default == "" else str(default)


def _from_env(flag: Flag, text: str) -> Any:
    value = flag.type(text)
    if flag.choices and value not in flag.choices:
        raise ValueError(f"choose from {', '.join(flag.choices)}")
    return value
