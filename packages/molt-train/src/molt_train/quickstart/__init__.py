"""The quickstart task shipped with molt-train: answer with the digit shown in the prompt.

`digits_env` (Env form) and `digits_chat` (ChatAgent form, stock openai SDK) are the same task;
`digits_train.jsonl` / `digits_eval.jsonl` are its prompts, `make_data.py` regenerates them.
"""

from pathlib import Path


def data_path(name: str) -> Path:
    """The path of a data file shipped in this folder."""
    return Path(__file__).parent / name
