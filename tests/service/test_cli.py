"""The ``headrace`` command: flags and their HEADRACE_* twins map onto the configs, and the
bundled client talks to an in-process server."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from compute.core.config import EngineConfig, SpeculativeConfig
from services.cli import cli, cli_flags
from services.server.server_config import ServerConfig
from tests.conftest import RunningServer

ROOT = Path(__file__).resolve().parents[2]


def _parse(argv: list[str], environ: dict[str, str] | None = None) -> cli_flags.Configs:
    return cli_flags.build_configs(cli.build_parser(environ or {}).parse_args(argv))


def test_serve_help_lists_every_flag_with_its_env_var(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.build_parser({}).parse_args(["serve", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in cli_flags.FLAGS:
        assert flag.option in text and flag.env in text, flag.option
    assert "--no-prefix-caching" in text
    assert len(re.findall(r"default:\s", text)) == len(cli_flags.FLAGS)  # may wrap


def test_every_config_field_has_a_flag() -> None:
    targets = {flag.target for flag in cli_flags.FLAGS}
    # EngineConfig's sub-configs, flagged field by field
    nested = {"cache", "scheduler", "device", "speculative"}
    for section, cls in cli_flags.sections().items():
        for field in dataclasses.fields(cls):
            if not (section == "engine" and field.name in nested) and (
                # sections of their own, flagged field by field
                f"{section}.{field.name}"
                not in ("server.limits", "server.connection", "server.security")
            ):
                assert f"{section}.{field.name}" in targets, f"{section}.{field.name} has no flag"


def test_defaults_are_the_dataclass_defaults() -> None:
    configs = _parse(["serve"])
    assert configs.engine == EngineConfig()
    assert configs.server == ServerConfig()
    assert configs.pipeline == type(configs.pipeline)()


def test_env_twin_overrides_default_and_flag_overrides_env() -> None:
    environ = {
        "HEADRACE_PORT": "6000",
        "HEADRACE_PREFIX_CACHING": "false",
        "HEADRACE_NUM_BLOCKS": "128",
        "HEADRACE_POLICY": "priority",
        "HEADRACE_MAX_PENDING": "9",
        "HEADRACE_GRACE_PERIOD": "2.5",
        "HEADRACE_LOG_FORMAT": "json",
    }
    configs = _parse(["serve"], environ)
    assert configs.server.port == 6000 and configs.server.grace_period == 2.5
    assert configs.engine.cache.enable_prefix_caching is False
    assert configs.engine.cache.num_blocks == 128
    assert configs.engine.scheduler.policy == "priority"
    assert configs.pipeline.max_pending == 9
    assert configs.log.format == "json"
    argv = ["serve", "--port", "7000", "--prefix-caching", "--num-blocks", "none"]
    flagged = _parse(argv, environ)
    assert flagged.server.port == 7000
    assert flagged.engine.cache.enable_prefix_caching is True
    assert flagged.engine.cache.num_blocks is None


def test_async_output_is_auto_unless_switched(capsys) -> None:
    def chosen(argv: list[str], environ: dict[str, str] | None = None) -> bool | None:
        return _parse(["serve", *argv], environ or {}).engine.device.async_output

    assert chosen([]) is None  # the engine decides: on for CUDA, off on the CPU
    assert chosen(["--async-output"]) is True
    assert chosen(["--no-async-output"]) is False
    assert chosen([], {"HEADRACE_ASYNC_OUTPUT": "off"}) is False
    assert chosen([], {"HEADRACE_ASYNC_OUTPUT": "auto"}) is None
    assert chosen(["--async-output"], {"HEADRACE_ASYNC_OUTPUT": "off"}) is True
    with pytest.raises(SystemExit):
        cli.build_parser({}).parse_args(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--async-output, --no-async-output" in help_text
    assert "HEADRACE_ASYNC_OUTPUT; default: auto]" in help_text


BAD_ENV = [
    {"HEADRACE_PORT": "http"},
    {"HEADRACE_DTYPE": "int3"},
    {"HEADRACE_CUDA_GRAPHS": "?"},
    {"HEADRACE_ASYNC_OUTPUT": "sometimes"},
]


@pytest.mark.parametrize("environ", BAD_ENV)
def test_bad_env_values_are_usage_errors(environ: dict[str, str], capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.build_parser(environ)
    assert exit_info.value.code == 2
    assert next(iter(environ)) in capsys.readouterr().err


def test_invalid_config_values_exit_2(capsys) -> None:
    assert cli.main(["serve", "--block-size", "12"]) == 2
    assert "block_size must be a positive power of two" in capsys.readouterr().err


def test_speculative_flags_and_env_twins(capsys) -> None:
    environ = {"HEADRACE_SPECULATIVE_METHOD": "ngram", "HEADRACE_SPECULATIVE_MAX_BATCH": "4"}
    argv = ["serve", "--num-speculative-tokens", "3", "--speculative-ngram-min", "2"]
    spec = _parse(argv, environ).engine.speculative
    assert spec == SpeculativeConfig(method="ngram", num_tokens=3, ngram_min=2, max_batch=4)
    max_n = SpeculativeConfig().ngram_max
    assert cli.main(["serve", "--speculative-ngram-min", str(max_n + 1)]) == 2
    assert "1 <= min <= max" in capsys.readouterr().err


def test_generate_streams_text_from_a_server(served: RunningServer, capsys) -> None:
    argv = ["generate", "--server", served.target, "--prompt", "Hi", "--max-tokens", "4"]
    assert cli.main(argv) == 0
    out = capsys.readouterr()
    assert out.out == " the quick brown fox\n"
    assert out.err.startswith("[length; 1 prompt + 4 completion tokens")
    assert cli.main([*argv, "--no-stream", "--stop", "brown"]) == 0
    assert capsys.readouterr().out == " the quick \n"


def test_generate_reads_stdin_and_chat(served: RunningServer, capsys, monkeypatch) -> None:
    monkeypatch.setattr(sys, "stdin", __import__("io").StringIO("from stdin"))
    assert cli.main(["generate", "--server", served.target, "--max-tokens", "2"]) == 0
    assert capsys.readouterr().out == " the quick\n"
    argv = ["generate", "--server", served.target, "--chat", "Hi", "--max-tokens", "1"]
    assert cli.main(argv) == 0
    assert "prompt + 1 completion" in capsys.readouterr().err


def test_generate_n_prints_each_sample_whole(served: RunningServer, capsys) -> None:
    argv = ["generate", "--server", served.target, "--prompt", "Hi", "--max-tokens", "2"]
    assert cli.main([*argv, "--n", "2"]) == 0
    out = capsys.readouterr()
    assert out.out == "[sample 0]\n the quick\n[sample 1]\n the quick\n"
    assert out.err.startswith("sample 0: [length; 1 prompt + 2 completion tokens")
    assert "\nsample 1: [length" in out.err


def test_generate_sends_logit_bias_and_min_tokens(served: RunningServer, capsys) -> None:
    argv = ["generate", "--server", served.target, "--prompt", "Hi", "--max-tokens", "3"]
    argv += ["--logit-bias", "5=-100", "--logit-bias", "7=2.5", "--min-tokens", "2"]
    assert cli.main(argv) == 0
    params = served.engine.params[served.engine.added[-1]]
    assert dict(params.logit_bias) == {5: -100.0, 7: 2.5} and params.min_tokens == 2
    with pytest.raises(SystemExit):
        cli.main([*argv, "--logit-bias", "five"])
    assert "expected ID=BIAS" in capsys.readouterr().err


def test_generate_reports_status_errors(served: RunningServer, capsys) -> None:
    argv = ["generate", "--server", served.target, "--prompt", "Hi", "--temperature", "-1"]
    assert cli.main(argv) == 1
    assert "error: INVALID_ARGUMENT: sampling.temperature" in capsys.readouterr().err


def test_info_and_health(served: RunningServer, capsys) -> None:
    assert cli.main(["info", "--server", served.target]) == 0
    assert json.loads(capsys.readouterr().out)["vocab_size"] == 49152
    assert cli.main(["health", "--server", served.target]) == 0
    assert capsys.readouterr().out.strip() == "SERVING"


def test_help_runs_as_a_module() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "services.cli.cli", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0
    assert all(name in result.stdout for name in ("serve", "generate", "info", "health"))


# -- the real engine (slow: loads the embedded SmolLM2) -----------------------------------


def _needs_default_model() -> None:
    from compute.loaders.base import ModelLoadError
    from compute.loaders.default_model import default_model_path

    try:
        default_model_path()
    except ModelLoadError as exc:
        pytest.skip(str(exc))


@pytest.mark.slow
def test_generate_offline(capsys) -> None:
    _needs_default_model()
    argv = ["generate", "--offline", "--device", "cpu", "--threads", "2", "--num-blocks", "64"]
    argv += ["--chat", "What is the capital of France?", "--temperature", "0"]
    assert cli.main([*argv, "--max-tokens", "24"]) == 0
    assert "Paris" in capsys.readouterr().out


def test_generate_offline_reads_only_its_engine_flags() -> None:
    """generate's per-request --seed shares its dest with the engine's --seed: unset, it
    must not become the engine's seed (None crashed every sampled step)."""
    argv = ["generate", "--offline", "--prompt", "x", "--temperature", "0.8"]
    args = cli.build_parser({}).parse_args(argv)
    assert cli_flags.build_configs(args, cli_flags.OFFLINE_FLAGS).engine.seed == 0
    args = cli.build_parser({}).parse_args([*argv, "--seed", "5", "--kv-cache-dtype", "int8"])
    configs = cli_flags.build_configs(args, cli_flags.OFFLINE_FLAGS)
    assert configs.engine.seed == 0 and configs.engine.cache.kv_cache_dtype == "int8"


@pytest.mark.slow
def test_generate_offline_samples_without_a_seed(capsys) -> None:
    _needs_default_model()
    argv = ["generate", "--offline", "--device", "cpu", "--threads", "2", "--num-blocks", "64"]
    argv += ["--prompt", "The capital of France is", "--temperature", "0.8", "--n", "2"]
    assert cli.main([*argv, "--max-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "[sample 0]" in out and "[sample 1]" in out


@pytest.mark.slow
def test_serve_announces_then_drains_and_exits_0_on_sigterm(tmp_path: Path) -> None:
    _needs_default_model()
    env = {**os.environ, "HEADRACE_PORT": "0", "HEADRACE_METRICS_PORT": "0"}
    argv = [sys.executable, "-m", "services.cli.cli", "serve", "--host", "127.0.0.1"]
    argv += ["--device", "cpu", "--threads", "2", "--num-blocks", "64", "--log-format", "json"]
    server = subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        ready = server.stdout.readline()
        assert ready.startswith("headrace ready:"), ready + server.stderr.read()
        target = re.search(r"on (\S+:\d+)", ready).group(1)
        assert "/metrics" in server.stdout.readline()
        result = subprocess.run(
            [sys.executable, "-m", "services.cli.cli", "generate", "--server", target,
             "--prompt", "Hello", "--max-tokens", "3"],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
        lines = server.stderr.read().splitlines()
        events = [json.loads(line)["event"] for line in lines if line.startswith("{")]
        assert "request complete" in events and "draining" in events and "stopped" in events
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


@pytest.mark.parametrize("status", [0, 1])
def test_serve_exits_with_the_servers_status(monkeypatch, status: int) -> None:
    # 1 = the step loop died (services/server/server.py): the supervisor must see a failure.
    import services.server.server

    monkeypatch.setattr(services.server.server, "run", lambda *args, **kwargs: status)
    assert cli.main(["serve", "--model", "dummy:tiny"]) == status
