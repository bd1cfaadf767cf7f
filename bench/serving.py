"""Serving benchmark: a thin wrapper over ``headrace bench serve`` (services/bench/).

Launches ``headrace serve`` with the flags after ``--`` (unless ``--server`` is given),
runs ``headrace bench serve`` with the flags before it, and writes
``bench/results/serving-<stamp>.json`` and ``.png`` beside it unless told otherwise, e.g.:

    python -m bench.serving --max-concurrency 16 --num-requests 64 -- --device cuda

Every flag is ``headrace bench serve``'s (``headrace bench serve --help``).
"""

from __future__ import annotations

import sys

from bench.common import RESULTS_DIR, timestamp
from services.cli import cli


def bench_argv(argv: list[str], stamp: str) -> list[str]:
    """``headrace bench serve`` arguments: --launch unless --server, default output paths."""
    ours, serve = (
        (argv[: argv.index("--")], argv[argv.index("--") :]) if "--" in argv else (argv, [])
    )
    given = {a.split("=", 1)[0] for a in ours}
    extra = [] if "--server" in given else ["--launch"]
    if "--result-json" not in given:
        extra += ["--result-json", str(RESULTS_DIR / f"serving-{stamp}.json")]
    if "--plot" not in given:
        extra += ["--plot", str(RESULTS_DIR / f"serving-{stamp}.png")]
    return ["bench", "serve", *extra, *ours, *serve]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return cli.main(bench_argv(argv, timestamp()))


if __name__ == "__main__":
    sys.exit(main())
