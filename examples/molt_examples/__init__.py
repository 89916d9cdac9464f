"""Agents for environments researchers already use (docs/environments.md). Each module is an
agent Molt loads by `--train.agent_path molt_examples.<module>`; its library is an extra."""
