"""Weights into the engines, and the code that runs inside vLLM's server process: the refit
control plane, the transfer backends and buckets, the adapter refit, the ASGI middlewares and
the vLLM version shims. Imports neither the engines nor the agents."""
