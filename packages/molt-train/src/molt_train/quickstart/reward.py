"""The quickstart task's reward, shared by its Env and ChatAgent forms.

The prompt shows ten characters of one kind ("0123456789" or "abcdefghij"), the row's label
names the kind ("digit" or "letter"), and the reply earns 1 when its first non-whitespace
character is of that kind, else 0. Only the first character counts: the reply is one token
(`max_tokens` 1 in the quickstart) from a byte-level BPE vocabulary, where a digit or a letter
may come as " 4", "00" or "sist", and each of those is an answer of the right kind. A longer
reply is judged the same way ("7 is my answer" is a digit).
"""

import string

KINDS = ("digit", "letter")


def character_kind(text: str) -> str | None:
    """ "digit" or "letter" for the first non-whitespace character of `text` (ASCII), else None."""
    stripped = text.lstrip()
    if not stripped:
        return None
    first = stripped[0]
    if first in string.digits:
        return "digit"
    if first in string.ascii_letters:
        return "letter"
    return None


def reward(reply: str, label: str) -> float:
    """1.0 when the reply starts with a character of the kind `label` names, else 0.0."""
    if label not in KINDS:
        raise ValueError(f"label {label!r}: expected one of {KINDS}")
    return 1.0 if character_kind(reply) == label else 0.0
