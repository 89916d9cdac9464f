"""The quickstart task: reply with a letter of the half of the alphabet the prompt shows
(`reward.py`; `halves_env`, `halves_chat`: its Env and ChatAgent; docs/getting-started.md)."""

from pathlib import Path


def data_path(name: str) -> Path:
    return Path(__file__).parent / name
