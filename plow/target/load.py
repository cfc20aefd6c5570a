"""Finding targets: a shipped name (`h200`) or a path to a target JSON file."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from pydantic import ValidationError

from plow.errors import ConfigError
from plow.target.model import Target


def shipped_targets() -> list[str]:
    """Names of the targets shipped in `plow/target/specs/`, sorted."""
    specs = resources.files("plow.target") / "specs"
    return sorted(p.name[: -len(".json")] for p in specs.iterdir() if p.name.endswith(".json"))


def parse_target(text: str, where: str | Path) -> Target:
    """A `Target` from JSON text; `ConfigError` names `where` and the first bad field."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(where, f"malformed JSON: {e}") from e
    try:
        return Target.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"]) or "target"
        raise ConfigError(where, f"field {loc!r}: {err['msg']}") from e


def load_target(name_or_path: str | Path) -> Target:
    """A shipped target by name (`h100`, `h200`, `b200`, `mi350x`, `cpu`) or a target JSON file.

    A path that exists wins over a shipped name; anything else is a `ConfigError` listing
    the shipped names.
    """
    p = Path(name_or_path)
    if p.is_file():
        try:
            text = p.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(p, f"cannot read target file: {e}") from e
        return parse_target(text, p)
    name = str(name_or_path)
    if name in shipped_targets():
        res = resources.files("plow.target") / "specs" / f"{name}.json"
        return parse_target(res.read_text(), f"target {name}")
    if p.suffix == ".json" or "/" in name:
        raise ConfigError(p, "target file not found")
    raise ConfigError(
        f"target {name!r}",
        f"unknown target (shipped: {', '.join(shipped_targets())}; or a JSON file)",
    )
