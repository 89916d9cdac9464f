"""The quickstart task shipped with molt-train: reply with a letter of the half shown.

The user turn is "abcdefghijklm" (label "a-m") or "nopqrstuvwxyz" (label "n-z"); the reply earns
1 when its first non-whitespace character is a letter of that half (`reward.py`). The
random-init tiny model starts near chance, about 0.2 (most tokens of its vocabulary start with
no letter, and the letters' tokens split between the halves about 58:42), and a policy that
ignores the prompt earns at most 0.5, so reaching 0.9 means the model learned to read the
prompt. benchmarks/quickstart_task_prototype.py shows it learns in 11-14 steps of 16 prompts x
8 samples, one-token replies, AdamW lr 5e-3.

`halves_env` (Env form) and `halves_chat` (ChatAgent form, stock openai SDK) are the same task;
`halves_train.jsonl` / `halves_eval.jsonl` are its prompts, `make_data.py` regenerates them.
"""

from pathlib import Path


def data_path(name: str) -> Path:
    """The path of a data file shipped in this folder."""
    return Path(__file__).parent / name
