"""Logs, metrics and tracing."""
