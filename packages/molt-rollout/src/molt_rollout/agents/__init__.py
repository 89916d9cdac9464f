"""Rollout logic: the agent contract and its runners, runner actors, the prompt-group pool,
prompt data and evaluation."""
