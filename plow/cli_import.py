"""`plow import-gguf FILE.gguf OUT`: a GGUF file as a plow checkpoint directory, its GGML
blocks kept (plow/checkpoint/gguf.py); `plow compile OUT` then plans it like any checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from plow.cli_common import Fail
from plow.errors import PlowError


def register(app: typer.Typer, fail: Fail) -> None:
    @app.command(name="import-gguf")
    def import_gguf_cmd(
        source: Annotated[Path, typer.Argument(help="A GGUF file of a llama model.")],
        out: Annotated[
            Path, typer.Argument(help="The checkpoint directory to write (new or empty).")
        ],
    ) -> None:
        """Import a GGUF file: Q4_0/Q4_1/Q8_0 tensors stay blocks, byte for byte, F32/F16 stay
        as they are; config and tokenizer through transformers' GGUF readers."""
        from plow.checkpoint.gguf import import_gguf
        from plow.checkpoint.weights import WeightStore

        console = Console()
        try:
            with console.status(f"importing {source.name}"):
                dest = import_gguf(source, out)
            store = WeightStore.open([dest / "model.safetensors"])
            console.print(
                f"imported {len(store)} tensors ({store.nbytes / 2**20:.1f} MiB) into {dest}; "
                f"next: plow compile {dest} -o BUNDLE",
                highlight=False,
            )
        except PlowError as e:
            fail(e)
