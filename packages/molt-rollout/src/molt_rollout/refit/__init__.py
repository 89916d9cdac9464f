"""Weights into the engines (refit control, transfer backends, buckets, adapter refit) and what
runs inside vLLM's server (middlewares, version shims). Imports neither engines nor agents."""
