"""The quickstart task's reward, shared by its Env and ChatAgent forms.

The prompt shows one half of the alphabet ("abcdefghijklm" or "nopqrstuvwxyz"), the row's label
names it ("a-m" or "n-z"), and the reply earns 1 when its first non-whitespace character is a
letter of that half, in either case, else 0. Only the first character counts: the reply is one
token (`max_tokens` 1 in the quickstart) from a byte-level BPE vocabulary, where a letter may
come as " b", "Ke" or "sist", and each of those is an answer of its letter's half. A longer
reply is judged the same way ("x marks it" is n-z).
"""

import string

HALVES = {"a-m": string.ascii_lowercase[:13], "n-z": string.ascii_lowercase[13:]}


def alphabet_half(text: str) -> str | None:
    """ "a-m" or "n-z" for the first non-whitespace character of `text` when it is an ASCII
    letter (either case), else None."""
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
