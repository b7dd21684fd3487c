"""What a reader does with a commit marker's format number (docs/checkpoint-format.md,
"Versioning"): it reads the numbers it knows and refuses the others, saying which trainer can
read them; it never guesses at a newer format."""

from __future__ import annotations

from collections.abc import Iterable

PREFIX = "tardigrade-checkpoint/"


def _number(name: object) -> int | None:
    if isinstance(name, str) and name.startswith(PREFIX) and name[len(PREFIX):].isdigit():
        return int(name[len(PREFIX):])
    return None


def why_unreadable(found: object, readable: Iterable[str]) -> str:
    """The reason a marker of format `found` is refused by a reader of `readable` formats."""
    known = sorted(readable)
    newest = max(n for n in map(_number, known) if n is not None)
    number = _number(found)
    if number is not None and number > newest:
        return (f"format {found!r} is newer than the formats this trainer reads "
                f"({', '.join(known)}): a newer Tardigrade trainer wrote it. Restore it with "
                "that trainer's image (or a newer one), or restore an older step")
    return (f"format {found!r} is not a Tardigrade checkpoint format this trainer reads "
            f"({', '.join(known)})")
