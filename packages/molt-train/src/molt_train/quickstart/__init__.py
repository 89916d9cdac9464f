"""The quickstart task shipped with molt-train: reply with a character of the kind shown.

The user turn is "0123456789" (label "digit") or "abcdefghij" (label "letter"); the reply earns
1 when its first non-whitespace character is of that kind (`reward.py`). The random-init tiny
model starts at chance, about 0.25 (one in four replies fits: most tokens start with a letter,
few with a digit), and a policy that ignores the prompt earns at most 0.5, so reaching 0.9
means the model learned to read the prompt. benchmarks/quickstart_task_prototype.py shows it
learns in 12-18 steps of 16 prompts x 8 samples, one-token replies, AdamW lr 5e-3.

`digits_env` (Env form) and `digits_chat` (ChatAgent form, stock openai SDK) are the same task;
`digits_train.jsonl` / `digits_eval.jsonl` are its prompts, `make_data.py` regenerates them.
"""

from pathlib import Path


def data_path(name: str) -> Path:
    """The path of a data file shipped in this folder."""
    return Path(__file__).parent / name
