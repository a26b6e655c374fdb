"""Reading the reference run's configuration (``config.Config``): a preset, a TOML file over it, ``--set``
overrides in order, each value converted to its field's type, and every section and key checked (a misspelt
one is refused naming the one it was probably meant to be)."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any

from samestep.records.durable import read_file
from samestep.train.config import PRESETS, Config
from samestep.train.spelling import did_you_mean

__all__ = ["build", "load_config"]


def build(raw: dict[str, Any], where: str = "config") -> Config:
    """The Config of the sections and keys in ``raw`` (each field's default where it has none), validated.

    Raises:
        ValueError: an unknown section or key (with the nearest known one), a section that is not a table, a
            value of the wrong type or one a field's check refuses; names ``where`` and the field.
    """
    sections = {f.name: f.default_factory for f in dataclasses.fields(Config)}  # type: ignore[misc]
    if unknown := sorted(set(raw) - set(sections)):
        raise ValueError(
            f"{where}: unknown section(s) {unknown}{did_you_mean(unknown[0], sections)}; known: {sorted(sections)}"
        )
    built = {}
    for name, factory in sections.items():
        values = raw.get(name, {})
        if not isinstance(values, dict):
            raise ValueError(
                f"{where}: {name} = {values!r} is not a section; write [{name}] and its keys "
                f"under it (e.g. [{name}] then key = value)"
            )
        known = {f.name for f in dataclasses.fields(factory())}
        if bad := sorted(set(values) - known):
            raise ValueError(
                f"{where}: unknown key(s) {', '.join(f'{name}.{k}' for k in bad)}"
                f"{did_you_mean(bad[0], known, name + '.')}; known: {', '.join(sorted(known))}"
            )
        base = factory()
        for key, value in values.items():
            values[key] = _coerce(f"{where}: {name}.{key}", getattr(base, key), value)
        built[name] = type(base)(**values)
    return Config(**built)


def _coerce(where: str, default: Any, value: Any) -> Any:
    """Converts ``value`` (a TOML value or a ``--set`` string) to the type of the field's default."""
    kind = type(default)
    if isinstance(value, str) and kind is not str:
        text = value.strip().lower()
        try:
            if kind is bool:
                if text not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                    raise ValueError
                return text in ("true", "1", "yes", "on")
            return kind(text)
        except ValueError:
            raise ValueError(f"{where}={value!r} is not a {kind.__name__}") from None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"{where}={value!r} is a {type(value).__name__}, expected {kind.__name__}")
    return value


def load_config(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (), preset: str | None = None
) -> Config:
    """Starts from a preset (optional, ``PRESETS``), reads a TOML file over it (optional), applies
    ``section.key=value`` overrides, and validates.

    Raises:
        ValueError: an unreadable file, an unknown section or key, a value of the wrong type, or a
            value that fails a field's check (each names the file or override and the field).
    """
    raw: dict[str, Any] = {}
    where = "config"
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"--preset {preset!r} is unknown; use one of {', '.join(PRESETS)}")
        raw = {section: dict(values) for section, values in PRESETS[preset].items()}
        where = f"preset {preset}"
    if path is not None:
        where = str(path)
        try:
            for section, values in tomllib.loads(read_file(path).decode("utf-8")).items():
                if isinstance(values, dict) and isinstance(raw.get(section), dict):
                    raw[section].update(values)
                else:
                    raw[section] = values
        except FileNotFoundError:
            raise ValueError(f"config file {path} does not exist") from None
        except OSError as e:  # a symlink loop, a name too long, no permission
            raise ValueError(f"config file {path} cannot be read ({e.strerror})") from None
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"config file {path} is not valid TOML: {e}") from None
    for item in overrides:
        name, sep, value = item.partition("=")
        section, dot, key = name.strip().partition(".")
        if not sep or not dot or not key:
            raise ValueError(f"--set {item!r}: expected section.key=value, e.g. train.steps=50")
        table = raw.setdefault(section, {})
        if not isinstance(table, dict):
            raise ValueError(
                f"{where}: {section} = {table!r} is not a section; write [{section}] and its keys under it"
            )
        table[key] = value
    return build(raw, where if not overrides else f"{where} with --set")
