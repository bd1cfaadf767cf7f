"""Transport and caller security: TLS, bearer-token auth and their configuration."""
