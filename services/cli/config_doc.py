"""docs/configuration.md, written from the flag table so the page cannot drift from it.

Every flag of ``FLAGS`` (services/cli/cli_flags.py) with its ``HEADRACE_*`` twin, its
default (the config dataclass's, as ``serve --help`` shows it), choices and help, grouped
by config section; the hand-written parts are the intro and the per-section notes
below. ``python -m services.cli.config_doc > docs/configuration.md`` (``make docs``)
rewrites the page; tests/service/test_config_doc.py fails when the committed one is stale.
"""

from __future__ import annotations

import sys

from kernels.cpu.quant import FORMATS
from services.cli.cli_flags import (
    FLAGS,
    OFFLINE_FLAGS,
    Flag,
    _auto_bool,
    _bool,
    _default,
    _shown,
    sections,
)

# The GGUF block formats `--weights quantized` keeps (kernels/cpu/quant.py FORMATS).
_FORMAT_NAMES = [f.ggml_type.name for f in FORMATS.values()]
_WEIGHT_FORMATS = ", ".join(_FORMAT_NAMES[:-1]) + " and " + _FORMAT_NAMES[-1]

INTRO = """\
Every `headrace serve` flag has a `HEADRACE_*` environment twin (flag > environment >
default); `headrace serve --help` lists them with their defaults. Pass flags through make
as `make serve ARGS="--max-num-seqs 32"`. `headrace generate --offline` (no server, the
engine in-process) takes only {offline}; `headrace export-tokenizer`
takes `--model` and `--chat-template`. The options of the bundled client commands
(`--server`, `--tls-ca`, ...) are in [security.md](security.md#clients).
"""

TITLES = {
    "server": "Server: ports, messages, drain",
    "connection": "Connections",
    "security": "Security",
    "limits": "Request limits",
    "engine": "Model",
    "device": "Device and kernels",
    "cache": "KV cache",
    "scheduler": "Scheduler",
    "speculative": "Speculative decoding",
    "pipeline": "Pipeline stages",
    "log": "Logs",
    "tracing": "Tracing",
}

NOTES = {
    "server": """\
`--max-batch-requests` caps the requests of one `GenerateBatch`. `--max-connection-age`
and `--max-connection-age-grace` rebalance clients behind L4 balancers
([deploying.md](deploying.md#service-mesh-and-routers)); `--tokenizer-dir` is for
gateways ([scaling-out.md](scaling-out.md)).
""",
    "connection": """\
What the idle, keepalive, handshake and metadata limits do on the wire:
[deploying.md](deploying.md#connections).
""",
    "security": """\
TLS covers the gRPC port and the HTTP side port (`/metrics`, `/health`); `/health` never
needs the token. Details, rotation and start-up checks: [security.md](security.md).
""",
    "limits": """\
Checked on the decoded message before any tokenizing; a violation is `INVALID_ARGUMENT`
naming the field ([api.md](api.md#request-limits)). `--max-request-bytes` covers a whole
`GenerateBatch`; `--max-chat-bytes` counts the UTF-8 bytes of all roles and contents.
""",
    "engine": """\
`--model default` is the embedded SmolLM2-135M-Instruct (Q4_1 GGUF); an HF checkpoint is a
directory of safetensors. `--seed` also seeds unseeded sampling.

`--chat-template FILE` replaces the model's chat template with a Jinja file, rendered as
transformers renders one (`messages`, `add_generation_prompt`, `bos_token`, `eos_token`).
Use it for a file that carries none (the Gemma 3 270M GGUF: a chat otherwise gets
INVALID_ARGUMENT "chat: no chat template (...)") or to fix one. The end-of-turn
tokens it writes (`<end_of_turn>`, `<|im_end|>`, `<|eot_id|>`, ...) become stop tokens, the
roles it names are accepted, and gateways get it in the exported tokenizer. A file that is
missing, not UTF-8, does not compile or fails on one user message stops start-up with a
message that names it.
""",
    "device": f"""\
- `--device auto` is CUDA when available; `--device cuda` needs CuPy (`make setup-gpu`).
  `--dtype auto` is fp32 on the CPU and bf16 on a GPU; CUDA takes `float16`/`bfloat16`
  only.
- `--threads`: the default is the CPUs in the process's affinity mask, capped by its
  cgroup CPU quota (`docker --cpus`, Kubernetes `limits.cpu`) and by torch's default; for
  replicas sharing a host see
  [deploying.md](deploying.md#several-replicas-on-one-host).
- `--cuda-graphs`: a step of n sequences uses the smallest captured size >= n, padded;
  prefill and mixed steps, larger batches and contexts over 8192 tokens run eagerly; a
  capture that fails is logged and the server runs eagerly;
  `GetModelInfo.cuda_graph_batch_sizes` says what was captured.
- `--async-output`: outputs come one step later, with the same tokens (tested on the
  CPU); off on the CPU, where a step is done when its launch returns, so there is nothing
  to overlap ([architecture.md](architecture.md)).
- `--weights` applies to GGUF models: `quantized` keeps the blocks of
  {_WEIGHT_FORMATS};
  `auto` is `quantized` on the CPU kernels, else `dense`. What each mode costs and how
  exact it is: [architecture.md](architecture.md#cpu-kernels-and-weight-modes).
""",
    "cache": """\
`--block-size` on CUDA: 16 or 32. With neither `--num-blocks` nor
`--kv-cache-memory-gib`, the KV cache on a GPU is what `--gpu-memory-utilization` (0.9)
of its memory leaves once the weights are loaded, less an estimate of the activations
and CUDA graphs still to come (the `kv cache sized` log line has every figure, the
`memory` line what is free after the graphs); on the CPU 256 tokens per `--max-num-seqs`
sequence (at least one `--max-model-len`). `--swap-space-gib` is used by
`--preemption-mode swap`.
""",
    "scheduler": """\
`--max-num-batched-tokens` counts decodes and prefill chunks; `--max-model-len` unset is
the model's context length. `--prefill-interval N`: after N steps mixing prefills into
decodes, one decode-only step (0 = off). `--policy priority` runs lower `priority` values
first.
""",
    "speculative": """\
`--speculative-method ngram` drafts up to `--num-speculative-tokens` tokens per decoding
sequence from the latest earlier match of its last n tokens (n from
`--speculative-ngram-max` down to `--speculative-ngram-min`), at most 2n - 1 of them (one
token after a one-token match, the whole draft after three), and verifies them in one step:
the same greedy tokens and the same sampling distribution as without it. No drafts while
more than `--speculative-max-batch` sequences run. It needs synchronous output (see
[architecture](architecture.md)).
""",
    "pipeline": """\
A request beyond `--max-pending` in flight is refused with RESOURCE_EXHAUSTED.
""",
    "log": "What the logs hold: [observability.md](observability.md#logs).\n",
    "tracing": "Spans and attributes: [observability.md](observability.md#tracing).\n",
}


def _cell(text: str) -> str:
    """Help text as a table cell: no column break, no HTML tag out of ``<token>``."""
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def _option(flag: Flag) -> str:
    if flag.type in (_bool, _auto_bool):
        return f"`{flag.option}` / `--no-{flag.option.removeprefix('--')}`"
    return f"`{flag.option}`"


def _row(flag: Flag, classes: dict[str, type]) -> str:
    default = _shown(_default(flag, classes), flag)
    choices = ", ".join(f"`{c}`" for c in flag.choices) if flag.choices else ""
    cells = (_option(flag), f"`{flag.env}`", f"`{default}`", choices, _cell(flag.help))
    return "| " + " | ".join(cells) + " |"


def render() -> str:
    """The whole page, as committed in docs/configuration.md."""
    classes = sections()
    order = list(dict.fromkeys(flag.target.split(".")[0] for flag in FLAGS))
    offline = ", ".join(f"`{option}`" for option in OFFLINE_FLAGS)
    lines = [
        "# Configuration",
        "",
        "<!-- Generated by `make docs` (python -m services.cli.config_doc) from"
        " services/cli/cli_flags.py; edit those, not this page. -->",
        "",
        INTRO.format(offline=offline),
    ]
    for section in order:
        lines += [f"## {TITLES[section]}", ""]
        lines += ["| flag | environment | default | choices | what |", "|---|---|---|---|---|"]
        lines += [_row(f, classes) for f in FLAGS if f.target.startswith(section + ".")]
        lines += ["", NOTES[section]]
    return "\n".join(lines).rstrip("\n") + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
