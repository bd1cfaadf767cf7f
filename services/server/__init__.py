"""The gRPC server process: start-up, status mapping, the HTTP endpoint and their config."""
