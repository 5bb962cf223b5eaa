"""Building frozen config dataclasses from TOML tables, with errors that name the key.

Each config class validates its own values in ``__post_init__``; this module only checks
that keys exist and that values have the declared scalar type, so a typo in a config file
is an error at start-up instead of a silently ignored setting.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from llm_shared.errors import ConfigError

T = TypeVar("T")


def _accepts(annotation: Any, value: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(a, value) for a in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is Any:
        return True
    if origin is typing.Literal:
        return value in typing.get_args(annotation)
    if origin in (tuple, list):
        args = typing.get_args(annotation)
        inner = args[0] if args else Any
        return isinstance(value, (list, tuple)) and all(_accepts(inner, v) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(annotation, type):
        return isinstance(value, annotation)
    return True


def build(cls: type[T], table: Any, section: str) -> T:
    """Instantiate dataclass ``cls`` from a TOML table, naming ``section.key`` in every error."""
    if not isinstance(table, dict):
        raise ConfigError(f"[{section}] must be a table")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    unknown = sorted(set(table) - set(fields))
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in [{section}]; known keys: {sorted(fields)}")
    kwargs: dict[str, Any] = {}
    for name, value in table.items():
        annotation = hints[name]
        if not _accepts(annotation, value):
            raise ConfigError(f"{section}.{name} has the wrong type: got {value!r}, expected {annotation}")
        if typing.get_origin(annotation) is tuple or (
            isinstance(value, list) and any(typing.get_origin(a) is tuple for a in typing.get_args(annotation))
        ):
            value = tuple(value)
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"[{section}]: {e}") from e


def require(condition: bool, message: str) -> None:
    """Validation helper for ``__post_init__`` methods."""
    if not condition:
        raise ConfigError(message)


def read_toml(path: str | Path) -> dict[str, Any]:
    """A config file's tables; ConfigError when it is missing or not TOML. Each process then
    builds only the tables it owns."""
    path = Path(path)
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise ConfigError(f"config file {str(path)!r} not found") from e
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {e}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {e}") from e
