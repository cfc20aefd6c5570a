"""The `plow` command line (DESIGN.md §6).

Every command turns a `PlowError` into one line `plow: <input>: <problem>` on stderr and its
exit status (2 bad input, 1 rejected plan / failed gate); `--debug` shows the traceback.
"""

from __future__ import annotations

import json
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console

from plow.errors import PlowError

app = typer.Typer(
    name="plow",
    help="plow: compile a HuggingFace checkpoint into a verified execution plan, and run it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err_console = Console(stderr=True)
_state = {"debug": False}


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")] = False,
) -> None:
    _state["debug"] = debug


class Executor(str, Enum):
    native = "native"
    reference = "reference"
    cpu = "cpu"
    cuda = "cuda"
    hip = "hip"


# the executors that run bundles (a checkpoint is compiled into a cached, verified bundle first)
BUNDLE_EXECUTORS = (Executor.native, Executor.cpu, Executor.cuda, Executor.hip)


def _fail(e: PlowError) -> NoReturn:
    if _state["debug"]:
        raise e
    err_console.print(f"plow: {e}", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(e.exit_code)


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError as e:
        raise PlowError("--prompt-ids", f"expected comma-separated integers, got {text!r}") from e
    if not ids:
        raise PlowError("--prompt-ids", "no token ids given")
    return ids


def _check_runnable(path: Path) -> None:
    """What `--no-verify` cannot skip: a bundle whose config or weights do not fit its plan
    cannot run at all (the packet streams would index past the tensors). Raises a one-line
    `PlowError` that says so, and suggests no flag."""
    from plow.bundle.manifest import WEIGHTS, read_manifest
    from plow.bundle.open import BundleRefused
    from plow.checkpoint.loader import spec_from_config
    from plow.checkpoint.weights import WeightStore
    from plow.runtime.cpu.bundle import _check_weights

    m = read_manifest(path)
    cfg_path = path / "config.json"
    try:
        config = json.loads(cfg_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PlowError(cfg_path, f"unreadable: {e}") from e
    if not isinstance(config, dict):
        raise PlowError(cfg_path, "expected a JSON object")
    spec = spec_from_config(config, cfg_path)
    have = {
        "layers": spec.num_layers,
        "hidden_size": spec.hidden_size,
        "vocab_size": spec.vocab_size,
    }
    for k, v in have.items():
        planned = getattr(m.model, k)
        if v != planned:
            raise PlowError(
                cfg_path,
                f"{k} {v}, the plan was compiled for {planned}: the bundle cannot run, even "
                "with --no-verify (recompile it)",
            )
    if not m.plan_only and (path / WEIGHTS).is_file():
        try:
            _check_weights(path, m, WeightStore.open([path / WEIGHTS]))
        except BundleRefused as e:
            raise PlowError(
                e.where, f"{e.problem}: the bundle cannot run, even with --no-verify (recompile it)"
            ) from e


@app.command()
def generate(
    model: Annotated[
        Path,
        typer.Argument(help="A checkpoint directory, or a bundle."),
    ],
    prompt: Annotated[
        str | None, typer.Option(help="Prompt text (tokenized with the model's tokenizer).")
    ] = None,
    prompt_ids: Annotated[
        str | None, typer.Option(help="Prompt as comma-separated token ids.")
    ] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Tokens to generate.")] = 32,
    executor: Annotated[
        Executor,
        typer.Option(
            help="native: the C++ persistent kernel (default); cpu: the checking emulator "
            "(numpy); reference: the per-op numpy forward."
        ),
    ] = Executor.native,
    threads: Annotated[
        int | None, typer.Option(min=1, help="Host threads per step (--executor native).")
    ] = None,
    ignore_eos: Annotated[
        bool, typer.Option(help="Keep generating past end-of-sequence tokens.")
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object (token_ids, text).")
    ] = False,
    temperature: Annotated[
        float, typer.Option(min=0.0, help="0 = greedy; > 0 samples (--executor cpu).")
    ] = 0.0,
    top_k: Annotated[int, typer.Option(min=0, help="Keep the k most likely (0 = off).")] = 0,
    top_p: Annotated[float, typer.Option(help="Nucleus mass in (0, 1] (1 = off).")] = 1.0,
    min_p: Annotated[float, typer.Option(help="Drop below min_p x max prob (0 = off).")] = 0.0,
    seed: Annotated[int | None, typer.Option(min=0, help="Sampling seed.")] = None,
    no_verify: Annotated[
        bool,
        typer.Option(
            "--no-verify", help="Run a bundle whose hashes or certificates do not check out."
        ),
    ] = False,
    kv_dtype: Annotated[
        str,
        typer.Option(
            help="Key-value cache storage: float32, or (opt-in, lossy) bfloat16 (--executor "
            "native or cpu) / fp8_e4m3 (--executor cpu)."
        ),
    ] = "float32",
) -> None:
    """Generate tokens from a prompt (greedy unless --temperature > 0). With --executor native
    or cpu a checkpoint is compiled once into a cached, verified bundle; a bundle runs as is."""
    from plow.checkpoint import load_checkpoint
    from plow.runtime.reference import generate_greedy
    from plow.runtime.sampler import SamplingParams

    try:
        if (prompt is None) == (prompt_ids is None):
            raise PlowError("generate", "give exactly one of --prompt or --prompt-ids")
        if kv_dtype not in ("float32", "bfloat16", "fp8_e4m3"):
            raise PlowError(
                "--kv-dtype", f"must be float32, bfloat16 or fp8_e4m3, not {kv_dtype!r}"
            )
        narrow = {Executor.cpu: ("bfloat16", "fp8_e4m3"), Executor.native: ("bfloat16",)}
        if kv_dtype != "float32" and kv_dtype not in narrow.get(executor, ()):
            where = " or ".join(e.value for e, kinds in narrow.items() if kv_dtype in kinds)
            raise PlowError(
                "--kv-dtype", f"{kv_dtype} runs on --executor {where}, not {executor.value}"
            )
        params = SamplingParams(temperature, top_k, top_p, min_p, seed)
        if not params.is_greedy and executor not in BUNDLE_EXECUTORS:
            raise PlowError(
                "--temperature", "stochastic sampling runs on --executor native, cpu or cuda"
            )
        from plow.bundle.open import NO_VERIFY_HINT, BundleRefused, is_bundle
        from plow.runtime.cpu.bundle import Bundle, compile_cached
        from plow.runtime.executors import checkpoint_target, get_executor

        kind = get_executor(executor.value)
        kind.check()  # a missing build or no GPU is reported before any compile
        bundle = None
        if is_bundle(model):
            if executor not in BUNDLE_EXECUTORS:
                raise PlowError(model, "a bundle runs on --executor native, cpu or cuda")
            if no_verify:
                _check_runnable(model)
            try:
                bundle = Bundle.open(model, verify=not no_verify)
            except BundleRefused as e:
                if NO_VERIFY_HINT in e.problem:
                    _check_runnable(model)  # the hint holds only if the bundle can run at all
                raise
            spec, tok = bundle.spec, bundle.tokenizer
        else:
            from plow.checkpoint.gguf import gguf_checkpoint

            model = gguf_checkpoint(model)  # a .gguf file: imported once, blocks kept
            ckpt = load_checkpoint(model)
            spec, tok = ckpt.spec, ckpt.tokenizer
            if executor in BUNDLE_EXECUTORS:
                tgt = checkpoint_target(executor.value)  # cuda: the present GPU's target
                bundle = Bundle.open(compile_cached(model, target=tgt))
        ids = _parse_ids(prompt_ids) if prompt_ids is not None else tok.encode(prompt or "")
        if not ids:
            raise PlowError("--prompt", "the prompt tokenizes to zero tokens")
        bad = [i for i in ids if not 0 <= i < spec.vocab_size]
        if bad:
            raise PlowError(
                "--prompt-ids",
                f"token id {bad[0]} outside the vocabulary 0..{spec.vocab_size - 1}",
            )
        if len(ids) + max_new_tokens > spec.max_position:
            raise PlowError(
                "--max-new-tokens",
                f"prompt {len(ids)} + {max_new_tokens} new tokens exceeds the model's "
                f"{spec.max_position} positions",
            )
        stop = () if ignore_eos else spec.eos_token_ids
        if bundle is not None:  # one path for every bundle executor (plow.runtime.executors)
            machine: dict[str, Any] = {}
            if executor is Executor.native:
                machine["threads"] = threads
            if executor in (Executor.native, Executor.cpu):
                machine["kv_dtype"] = kv_dtype
            out, _ = kind.generate(
                bundle, ids, max_new_tokens, params=params, stop_ids=stop, **machine
            )
        else:
            out = generate_greedy(ckpt, ids, max_new_tokens, stop_ids=stop)
        text = tok.decode(out)
    except PlowError as e:
        _fail(e)
    if as_json:
        doc: dict[str, Any] = {
            "token_ids": out,
            "text": text,
            "prompt_ids": ids,
            "executor": executor.value,
        }
        if kv_dtype != "float32":
            doc.update(kv_dtype=kv_dtype, lossy=True)
        print(json.dumps(doc))
    else:
        print(text)


@app.command(name="eval")
def eval_(
    workload: Annotated[
        Path | None,
        typer.Argument(
            help="A workload YAML, or the name of a shipped one (harness/workloads/); "
            "none runs the embedded default study."
        ),
    ] = None,
    executor: Annotated[
        Executor | None, typer.Option(help="Run on this executor instead of the workload's.")
    ] = None,
) -> None:
    """Run a gated evaluation (no argument: the embedded default study); exit 1 on a
    rejected plan or a failed correctness gate."""
    from harness.run import run_study

    try:
        outcome = run_study(workload, executor=executor.value if executor else None)
        if outcome.exit_code:
            err_console.print(f"plow: eval: {outcome.message}", markup=False, highlight=False)
            raise typer.Exit(outcome.exit_code)
    except PlowError as e:
        _fail(e)


from plow.cli_plan import register as _register_plan  # noqa: E402  (compile, calibrate)

_register_plan(app, _fail)

from plow.cli_import import register as _register_import  # noqa: E402  (import-gguf)

_register_import(app, _fail)

from plow.serve.cli import register as _register_serve  # noqa: E402  (serve, calibrate prefill)

_register_serve(app, _fail)


def main() -> None:
    try:
        app()
    except PlowError as e:  # raised outside a command's own handler
        if _state["debug"]:
            raise
        print(f"plow: {e}", file=sys.stderr)
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main()
