"""The benchmarks, each run as ``python -m bench.<name>`` from the repository root.

Shared plumbing: ``bench.common`` (machine and commit facts, the result JSON and PNG) and
``bench.procs`` (server processes, RSS, free ports). See bench/README.md.
"""
