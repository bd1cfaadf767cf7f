"""The headrace.v1 gRPC adapter: the servicer and its protobuf <-> domain conversion."""
