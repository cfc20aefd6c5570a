"""What the command modules share: the error reporter they are given, and the `calibrate`
group that several of them add commands to."""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

import typer

from plow.errors import PlowError

# Prints a `PlowError` as one line and exits with its status (plow.cli._fail).
Fail = Callable[[PlowError], NoReturn]


def calibrate_group(app: typer.Typer) -> typer.Typer:
    """The `plow calibrate` group, created on first use."""
    for g in app.registered_groups:
        if g.name == "calibrate" and g.typer_instance is not None:
            return g.typer_instance
    group = typer.Typer(
        help="Measure this machine (or a model) and write calibration data.", no_args_is_help=True
    )
    app.add_typer(group, name="calibrate")
    return group
