"""The checkpoint's tokenizer (`tokenizer.json` through the `tokenizers` library)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from plow.errors import CheckpointError


@dataclass(frozen=True)
class Tokenizer:
    inner: HFTokenizer
    bos_token: str | None = None
    eos_token: str | None = None
    chat_template: str | None = None
    add_bos: bool = False
    config: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, directory: Path) -> Tokenizer:
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(path, "file not found")
        try:
            inner = HFTokenizer.from_file(str(path))
        except Exception as e:  # the Rust library raises plain Exceptions
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise CheckpointError(path, f"cannot read the tokenizer: {first}") from e
        cfg: dict[str, Any] = {}
        cfg_path = directory / "tokenizer_config.json"
        if cfg_path.is_file():
            try:
                cfg = json.loads(cfg_path.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CheckpointError(cfg_path, f"malformed JSON: {e}") from e
            if not isinstance(cfg, dict):
                raise CheckpointError(cfg_path, "expected a JSON object")

        def token(key: str) -> str | None:
            v = cfg.get(key)
            return v.get("content") if isinstance(v, dict) else v

        # transformers >= 5 writes the chat template to its own file.
        template = cfg.get("chat_template")
        jinja = directory / "chat_template.jinja"
        if template is None and jinja.is_file():
            template = jinja.read_text()
        return cls(
            inner=inner,
            bos_token=token("bos_token"),
            eos_token=token("eos_token"),
            chat_template=template,
            add_bos=bool(cfg.get("add_bos_token", False)),
            config=cfg,
        )

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self.inner.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token is not None:
            bos = self.inner.token_to_id(self.bos_token)
            if bos is not None:
                ids = [bos, *ids]
        return ids

    def decode(self, ids: list[int]) -> str:
        text: str = self.inner.decode(ids, skip_special_tokens=True)
        return text

    @property
    def vocab_size(self) -> int:
        return int(self.inner.get_vocab_size(with_added_tokens=True))

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.inner.token_to_id(token)
