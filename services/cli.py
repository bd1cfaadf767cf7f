"""The ``headrace`` command: ``serve``, ``generate`` (the bundled client), ``info``, ``health``.

Every serving knob is a flag with a ``HEADRACE_*`` environment twin; ``FLAGS``
is the one table mapping both onto the frozen config dataclasses (precedence:
flag, then environment, then the dataclass default).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from compute.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from services.client import DEFAULT_SERVER
from services.log import FORMATS, LEVELS, LogConfig
from services.server_config import ServerConfig

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


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true/false, got {text!r}")


FLAGS: tuple[Flag, ...] = (
    Flag("--host", "server.host", "interface the gRPC and metrics servers listen on"),
    Flag("--port", "server.port", "gRPC port (0 = any free port)", int),
    Flag("--metrics-port", "server.metrics_port", "Prometheus /metrics port (-1 = off)", int),
    Flag("--max-message-bytes", "server.max_message_bytes", "largest gRPC message", int),
    Flag("--grace-period", "server.grace_period", "seconds to finish streams on SIGTERM", float),
    Flag("--max-batch-requests", "server.max_batch_requests", "most requests per batch call", int),
    Flag("--model", "engine.model", '"default" (SmolLM2), a .gguf, an HF dir or "dummy:<shape>"'),
    Flag("--seed", "engine.seed", "seed of the global generator and of dummy weights", int),
    Flag("--device", "device.device", "auto, cpu, cuda or cuda:N"),
    Flag("--dtype", "device.dtype", "precision",
         choices=("auto", "float32", "float16", "bfloat16")),
    Flag("--threads", "device.num_threads", "torch CPU threads (none = torch's)", _optional_int),
    Flag("--cuda-graphs", "device.cuda_graphs", "capture decode steps in CUDA graphs", _bool),
    Flag("--block-size", "cache.block_size", "tokens per KV block (power of two)", int),
    Flag("--num-blocks", "cache.num_blocks", "KV blocks (none = from memory)", _optional_int),
    Flag("--kv-cache-memory-gib", "cache.memory_gib", "KV memory if --num-blocks unset", float),
    Flag("--prefix-caching", "cache.enable_prefix_caching", "share KV of common prefixes", _bool),
    Flag("--swap-space-gib", "cache.swap_space_gib", "host memory for swapped KV blocks", float),
    Flag("--max-num-seqs", "scheduler.max_num_seqs", "most sequences running in one step", int),
    Flag("--max-num-batched-tokens", "scheduler.max_num_batched_tokens", "step token budget", int),
    Flag("--max-model-len", "scheduler.max_model_len", "prompt + output cap", _optional_int),
    Flag("--preemption-mode", "scheduler.preemption_mode", "when KV blocks run out",
         choices=("recompute", "swap")),
    Flag("--prefill-interval", "scheduler.prefill_interval", "most prefill steps in a row", int),
    Flag("--policy", "scheduler.policy", "scheduling order", choices=("fcfs", "priority")),
    Flag("--max-pending", "pipeline.max_pending", "requests in flight, then rejected", int),
    Flag("--tokenize-workers", "pipeline.tokenize_workers", "tokenizer threads (stage 1)", int),
    Flag("--output-workers", "pipeline.output_workers", "detokenizer threads (stage 3)", int),
    Flag("--log-level", "log.level", "log level", choices=LEVELS),
    Flag("--log-format", "log.format", "json, console or auto (console on a TTY)", choices=FORMATS),
)  # fmt: skip
# The subset that `generate --offline` uses to build its in-process engine.
OFFLINE_FLAGS = ("--model", "--device", "--dtype", "--threads", "--num-blocks",
                 "--kv-cache-memory-gib", "--max-model-len")  # fmt: skip


def sections() -> dict[str, type]:
    """Config dataclass of each FLAGS section."""
    from services.pipeline import PipelineConfig

    return {
        "server": ServerConfig,
        "engine": EngineConfig,
        "device": DeviceConfig,
        "cache": CacheConfig,
        "scheduler": SchedulerConfig,
        "pipeline": PipelineConfig,
        "log": LogConfig,
    }


@dataclass(frozen=True)
class Configs:
    engine: EngineConfig
    pipeline: Any  # services.pipeline.PipelineConfig (imported lazily: it pulls in torch)
    server: ServerConfig
    log: LogConfig


def build_configs(args: argparse.Namespace) -> Configs:
    """The frozen configs from parsed flags (flags a subcommand lacks keep their defaults)."""
    classes = sections()
    values: dict[str, dict[str, Any]] = {name: {} for name in classes}
    for flag in FLAGS:
        if hasattr(args, flag.dest):
            section, field = flag.target.split(".")
            values[section][field] = getattr(args, flag.dest)
    built = {name: cls(**values[name]) for name, cls in classes.items() if name != "engine"}
    engine = EngineConfig(
        **values["engine"],
        cache=built["cache"],
        scheduler=built["scheduler"],
        device=built["device"],
    )
    return Configs(engine, built["pipeline"], built["server"], built["log"])


def _default(flag: Flag, classes: Mapping[str, type]) -> Any:
    section, field = flag.target.split(".")
    return next(f.default for f in dataclasses.fields(classes[section]) if f.name == field)


def _add_flags(
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
            "help": f"{flag.help} [env {flag.env}; default: {_shown(default)}]"
        }
        if flag.type is _bool:
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


def _shown(default: Any) -> str:
    if isinstance(default, bool):
        return "on" if default else "off"
    return "none" if default is None else str(default)


def _from_env(flag: Flag, text: str) -> Any:
    value = flag.type(text)
    if flag.choices and value not in flag.choices:
        raise ValueError(f"choose from {', '.join(flag.choices)}")
    return value


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The ``headrace`` parser; ``environ`` (default os.environ) supplies the env twins."""
    environ = os.environ if environ is None else environ
    classes = sections()
    parser = argparse.ArgumentParser(prog="headrace", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="run the gRPC service", description=SERVE_HELP)
    _add_flags(serve, FLAGS, environ, classes)

    generate = commands.add_parser(
        "generate", help="generate text through a server (or --offline)", description=GEN_HELP
    )
    _add_server_flag(generate, environ)
    _add_generate_flags(generate)
    offline = [f for f in FLAGS if f.option in OFFLINE_FLAGS]
    _add_flags(generate, offline, environ, classes, "--offline engine (env twins as for serve)")

    info = commands.add_parser("info", help="print the served model's GetModelInfo as JSON")
    _add_server_flag(info, environ)
    health = commands.add_parser("health", help="grpc.health.v1 check; exit 0 when SERVING")
    _add_server_flag(health, environ)
    health.add_argument("--service", default="", help='service to check ("" = whole server)')
    return parser


SERVE_HELP = "Serve headrace.v1.GenerationService over gRPC until SIGTERM/SIGINT, then drain."
GEN_HELP = (
    "Generate from --prompt, --chat (one user message) or stdin; the text goes to stdout, "
    "a summary line to stderr."
)


def _add_server_flag(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    env = ENV_PREFIX + "SERVER"
    parser.add_argument(
        "--server",
        default=environ.get(env, DEFAULT_SERVER),
        metavar="HOST:PORT",
        help=f"server address [env {env}; default: {DEFAULT_SERVER}]",
    )
    parser.add_argument("--timeout", type=float, help="deadline of the call in seconds")


def _add_generate_flags(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--prompt", help="raw prompt text (no chat template)")
    source.add_argument("--chat", metavar="MESSAGE", help="one user message, chat template applied")
    parser.add_argument(
        "--stream", action=argparse.BooleanOptionalAction, default=True,
        help="print text as it is generated (default: on)",
    )  # fmt: skip
    parser.add_argument("--temperature", type=float, help="0 = greedy (default: 1.0)")
    parser.add_argument("--top-p", type=float, help="nucleus mass in (0, 1] (default: 1.0)")
    parser.add_argument("--top-k", type=int, help="keep the k most likely tokens (default: all)")
    parser.add_argument("--max-tokens", type=int, help="most new tokens (default: 256)")
    parser.add_argument("--seed", type=int, help="this request's sampling seed")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--request-id", default="", help="request id (default: a UUID)")
    parser.add_argument(
        "--offline", action="store_true",
        help="run the engine in this process instead of calling a server",
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``headrace`` console script."""
    import grpc

    from services.domain import RequestError

    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except grpc.RpcError as exc:
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except RequestError as exc:
        print(f"error: {exc.code}: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # a config dataclass refused a value
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _serve(args: argparse.Namespace) -> int:
    from services import log
    from services.server import run

    configs = build_configs(args)
    log.configure(configs.log)
    run(configs.engine, configs.pipeline, configs.server, on_ready=_announce)
    return 0


def _announce(server: Any) -> None:
    config = server.config
    host = "localhost" if config.host in ("0.0.0.0", "::", "") else config.host
    print(f"headrace ready: gRPC headrace.v1.GenerationService on {host}:{server.port}", flush=True)
    if server.metrics_port is not None:
        print(f"  metrics: http://{host}:{server.metrics_port}/metrics", flush=True)
    print(f"  try: headrace generate --server {host}:{server.port} --prompt 'Hello'", flush=True)


def _generate(args: argparse.Namespace) -> int:
    from services import client, log

    log.configure(LogConfig(level="warning"))
    text = args.prompt if args.prompt is not None else args.chat
    if text is None:
        text = sys.stdin.read()
    request = client.generate_request(
        text if args.chat is None else None,
        chat=[("user", text)] if args.chat is not None else None,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.seed,
        stop=args.stop,
        request_id=args.request_id,
    )
    if args.offline:
        configs = build_configs(args)
        with client.OfflineClient(configs.engine, configs.pipeline) as offline:
            client.print_responses(offline.generate(request), args.stream)
    else:
        with client.Client(args.server, timeout=args.timeout) as remote:
            client.print_responses(remote.generate(request), args.stream)
    return 0


def _info(args: argparse.Namespace) -> int:
    from google.protobuf import json_format

    from services.client import Client

    with Client(args.server, timeout=args.timeout) as remote:
        info = remote.model_info()
    print(json.dumps(json_format.MessageToDict(info, preserving_proto_field_name=True), indent=2))
    return 0


def _health(args: argparse.Namespace) -> int:
    from services.client import Client

    with Client(args.server, timeout=args.timeout) as remote:
        status = remote.health(args.service)
    print(status)
    return 0 if status == "SERVING" else 1


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "serve": _serve,
    "generate": _generate,
    "info": _info,
    "health": _health,
}


if __name__ == "__main__":
    sys.exit(main())
