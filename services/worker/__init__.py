"""The vLLM worker protocol (``vllm.grpc.engine.VllmEngine``) over headrace's pipeline.

Gateways that speak it (SMG, llm-d's endpoint picker) tokenize themselves and send token
ids; this package answers them from the same Pipeline as headrace.v1. The stubs come from
the published ``smg-grpc-proto`` package; the proto is never copied here.
"""
