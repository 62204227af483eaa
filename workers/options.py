"""How a settings field appears on the command line: an `Option` in the field's metadata makes it a
`kvtc calibrate` flag named after the field (`seq_len` -> `--seq-len`).

Here, in the lowest layer that declares settings (workers: CaptureSettings), so every settings group
declares its options on its own fields; kvtc.pipeline.settings collects them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable


@dataclass(frozen=True)
class Option:
    """`kind`: the argparse type of the word; `parse`: word -> field value when that is not `kind`
    (lists, 'none'); `show`: field value -> word."""

    help: str = ""
    kind: type = str
    choices: tuple[str, ...] | None = None
    parse: Callable[[Any], Any] | None = None
    show: Callable[[Any], str] | None = None

    def value(self, word: Any) -> Any:
        return self.parse(word) if self.parse is not None else word


def option(default: Any, help: str = "", **kw) -> Any:
    """A dataclass field that is also a `kvtc calibrate` option."""
    return field(default=default, metadata={"option": Option(help, **kw)})


def numbers(kind: type, flag: str) -> Callable[[Any], tuple]:
    """Parser of a comma-separated list of `kind` (a tuple or list passes through, converted)."""
    def parse(word: Any) -> tuple:
        if isinstance(word, (tuple, list)):
            return tuple(kind(x) for x in word)
        try:
            return tuple(kind(x) for x in str(word).split(",") if x.strip())
        except ValueError:
            raise ValueError(f"{flag} must be comma-separated numbers, got {word!r}") from None
    return parse


def words(word: Any) -> tuple[str, ...]:
    """A comma-separated list of words (a tuple or list passes through)."""
    if isinstance(word, (tuple, list)):
        return tuple(word)
    return tuple(t.strip() for t in str(word).split(",") if t.strip())


def joined(value: Any) -> str:
    """A tuple as its option word: "1,16,64"."""
    return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in value)


class Word(str, Enum):
    """A switch whose members are its option words: a `str` enum, so it compares, hashes and JSON-encodes as
    its word, and formats as it (`f"{x}"`, `str(x)`). `of` reads a word, refusing any other naming the choices."""

    __str__ = str.__str__
    __format__ = str.__format__

    @classmethod
    def words(cls) -> tuple[str, ...]:
        """The words, in declaration order (the option's choices)."""
        return tuple(m.value for m in cls)

    @classmethod
    def of(cls, word: Any, what: str):
        """The member `word` names (a member passes through); ValueError "{what} must be one of ..." otherwise."""
        try:
            return cls(word)
        except (ValueError, TypeError):
            raise ValueError(f"{what} must be one of {cls.words()}, got {word!r}") from None
