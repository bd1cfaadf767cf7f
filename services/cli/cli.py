"""The ``headrace`` command: serve, generate, info, health, export-tokenizer, bench serve.

``generate``, ``info`` and ``health`` are the bundled client; ``export-tokenizer`` writes the
model's tokenizer for a gateway; ``bench serve`` is the serving benchmark (services/bench/).

Every serving knob is a flag with a ``HEADRACE_*`` environment twin; the table
mapping both onto the frozen config dataclasses is ``FLAGS`` in services/cli/cli_flags.py
(precedence: flag, then environment, then the dataclass default).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from services.bench import command as bench_command
from services.bench import flags as bench_flags
from services.cli.cli_flags import (
    ENV_PREFIX,
    FLAGS,
    OFFLINE_FLAGS,
    add_flags,
    build_configs,
    sections,
)
from services.client import client_security
from services.client.client import DEFAULT_SERVER
from services.telemetry.log import LogConfig


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The ``headrace`` parser; ``environ`` (default os.environ) supplies the env twins."""
    environ = os.environ if environ is None else environ
    classes = sections()
    parser = argparse.ArgumentParser(prog="headrace", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="run the gRPC service", description=SERVE_HELP)
    add_flags(serve, FLAGS, environ, classes)

    generate = commands.add_parser(
        "generate", help="generate text through a server (or --offline)", description=GEN_HELP
    )
    _add_server_flag(generate, environ)
    _add_generate_flags(generate)
    offline = [f for f in FLAGS if f.option in OFFLINE_FLAGS]
    add_flags(generate, offline, environ, classes, "--offline engine (env twins as for serve)")

    info = commands.add_parser("info", help="print the served model's GetModelInfo as JSON")
    _add_server_flag(info, environ)
    health = commands.add_parser(
        "health", help="grpc.health.v1 check; exit 0 SERVING, 1 not, 2 unreachable",
        description=HEALTH_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    _add_server_flag(health, environ)
    health.add_argument("--service", default="", help='service to check ("" = whole server)')
    export = commands.add_parser(
        "export-tokenizer",
        help="write the model's tokenizer for a gateway",
        description=EXPORT_HELP,
    )
    export.add_argument("directory", metavar="DIR", help="created if missing")
    add_flags(
        export, [f for f in FLAGS if f.option in ("--model", "--chat-template")], environ, classes
    )
    bench_flags.add_parser(commands, environ.get(ENV_PREFIX + "SERVER", DEFAULT_SERVER), environ)
    return parser


SERVE_HELP = (
    "Serve headrace.v1.GenerationService over gRPC until SIGTERM/SIGINT, then drain. The same "
    "port also answers the vLLM worker protocol (vllm.grpc.engine.VllmEngine) for gateways "
    "such as SMG; see docs/scaling-out.md. TLS, mutual TLS and bearer tokens: --tls-cert, "
    "--tls-key, --tls-client-ca, --auth-token-file (docs/security.md)."
)
EXPORT_HELP = (
    "Write tokenizer.json, tokenizer_config.json (with the chat template) and "
    "generation_config.json of --model into DIR, for a gateway that tokenizes itself "
    "(smg --tokenizer-path DIR). `serve` writes the same files at start-up (--tokenizer-dir) "
    "and reports the path in the vLLM worker protocol's GetModelInfo."
)
HEALTH_HELP = """Ask the server's grpc.health.v1 service; print the status; the exit code says it:
  0  SERVING
  1  answered, but not SERVING (NOT_SERVING while loading or draining; unknown --service)
  2  no answer: connection refused, name not resolved, or --timeout (default 5 s) passed
Container HEALTHCHECKs and scripts use it as the probe."""
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
    client_security.add_flags(parser, environ)


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
    parser.add_argument(
        "--n", type=int,
        help="samples of the prompt, each printed whole after a [sample i] line (default: 1)",
    )  # fmt: skip
    parser.add_argument(
        "--logit-bias", action="append", default=[], type=_logit_bias, metavar="ID=BIAS",
        help="add BIAS (-100..100) to token ID's logit (repeatable)",
    )  # fmt: skip
    parser.add_argument(
        "--min-tokens", type=int, help="no EOS, stop token or stop string before this many tokens"
    )
    parser.add_argument("--request-id", default="", help="request id (default: a UUID)")
    parser.add_argument(
        "--offline", action="store_true",
        help="run the engine in this process instead of calling a server",
    )  # fmt: skip


def _logit_bias(value: str) -> tuple[int, float]:
    token, sep, bias = value.partition("=")
    try:
        if sep:
            return int(token), float(bias)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"expected ID=BIAS, e.g. 1234=-100, got {value!r}")


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
    from services.server.server import run
    from services.telemetry import log

    configs = build_configs(args)
    log.configure(configs.log)
    # 1 when a pipeline stage died: the supervisor restarts the server (services/server/server.py)
    return run(configs.engine, configs.pipeline, configs.server, _announce, configs.tracing)


def _announce(server: Any) -> None:
    config = server.config
    host = "localhost" if config.host in ("0.0.0.0", "::", "") else config.host
    security = config.security
    print(f"headrace ready: gRPC headrace.v1.GenerationService on {host}:{server.port}", flush=True)
    if server.metrics_port is not None:
        scheme = "https" if security.tls else "http"
        print(f"  metrics: {scheme}://{host}:{server.metrics_port}/metrics", flush=True)
    print(f"  also: vLLM worker protocol for gateways on {host}:{server.port}", flush=True)
    hint = " --tls-ca CA.pem" if security.tls else ""
    hint += " --tls-cert CLIENT.pem --tls-key CLIENT.key" if security.tls_client_ca else ""
    hint += " --auth-token-file TOKEN_FILE" if security.auth else ""
    print(
        f"  try: headrace generate --server {host}:{server.port}{hint} --prompt 'Hello'", flush=True
    )


# generate's flags that go into the request as they are
_REQUEST_OPTIONS = (
    "temperature", "top_p", "top_k", "max_tokens", "seed", "stop", "request_id", "n", "min_tokens",
)  # fmt: skip


def _generate(args: argparse.Namespace) -> int:
    from services.client import client
    from services.telemetry import log

    log.configure(LogConfig(level="warning"))
    text = args.prompt if args.prompt is not None else args.chat
    if text is None:
        text = sys.stdin.read()
    chat = [("user", text)] if args.chat is not None else None
    options = {k: getattr(args, k) for k in _REQUEST_OPTIONS}
    options["logit_bias"] = dict(args.logit_bias)  # the last of a repeated id wins
    request = client.generate_request(None if chat else text, chat=chat, **options)
    n = args.n or 1
    if args.offline:
        configs = build_configs(args, OFFLINE_FLAGS)
        with client.OfflineClient(configs.engine, configs.pipeline) as offline:
            client.print_responses(offline.generate(request), args.stream, n)
    else:
        with client.Client(args.server, args.timeout, _security(args)) as remote:
            client.print_responses(remote.generate(request), args.stream, n)
    return 0


def _info(args: argparse.Namespace) -> int:
    from google.protobuf import json_format

    from services.client.client import Client

    with Client(args.server, args.timeout, _security(args)) as remote:
        info = remote.model_info()
    print(json.dumps(json_format.MessageToDict(info, preserving_proto_field_name=True), indent=2))
    return 0


def _health(args: argparse.Namespace) -> int:
    import grpc

    from services.client.client import Client

    try:
        with Client(args.server, args.timeout or 5.0, _security(args)) as remote:
            status = remote.health(args.service)
    except grpc.RpcError as exc:
        if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            print(f"UNREACHABLE: {exc.code().name}: {exc.details()}")
            return 2
        print(f"{exc.code().name}: {exc.details()}")  # e.g. NOT_FOUND for an unknown service
        return 1
    print(status)
    return 0 if status == "SERVING" else 1


def _security(args: argparse.Namespace) -> client_security.ClientSecurity:
    return client_security.ClientSecurity.from_args(args, os.environ)


def _export_tokenizer(args: argparse.Namespace) -> int:
    from compute.loaders import load_model, read_template_flag, with_chat_template
    from services.worker.tokenizer_export import FILES, export_tokenizer

    template = read_template_flag(args.chat_template) if args.chat_template else None
    loaded = load_model(args.model or "default", progress=False)
    if loaded.tokenizer is None:
        print(f"error: model {args.model!r} has no tokenizer", file=sys.stderr)
        return 2
    if template is not None:
        loaded = with_chat_template(loaded, template)
    max_len = loaded.config.max_position_embeddings
    out = export_tokenizer(loaded.tokenizer, args.directory, max_len)
    print(f"wrote {', '.join(FILES)} to {out}")
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "serve": _serve,
    "generate": _generate,
    "info": _info,
    "health": _health,
    "export-tokenizer": _export_tokenizer,
    "bench": bench_command.main,
}


if __name__ == "__main__":
    sys.exit(main())
