"""The headrace.v1 client and its TLS/token options."""
