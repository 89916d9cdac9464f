"""The quickstart task's reward, shared by its Env and ChatAgent forms. Only the reply's first
character counts: a byte-level BPE token such as " b", "Ke" or "sist" answers for its half."""

import string

HALVES = {"a-m": string.ascii_lowercase[:13], "n-z": string.ascii_lowercase[13:]}


def alphabet_half(text: str) -> str | None:
    """ "a-m" or "n-z" for the first non-whitespace character when an ASCII letter, else None."""
    first = text.lstrip()[:1]
    # ASCII before lowering: the Kelvin sign (U+212A) lowers to "k". "" is in every string.
    if not first or first not in string.ascii_letters:
        return None
    return "a-m" if first.lower() in HALVES["a-m"] else "n-z"


def reward(reply: str, label: str) -> float:
    """1.0 when the reply starts with a letter of the half `label` names, else 0.0."""
    if label not in HALVES:
        raise ValueError(f"label {label!r}: expected one of {tuple(HALVES)}")
    return 1.0 if alphabet_half(reply) == label else 0.0
