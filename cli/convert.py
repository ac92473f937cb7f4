"""``weave convert``: turn a GGUF model of any quantization into Weave's shared Q4_0 format.

Runs in-process. The converter (numpy, gguf-py) and rich's progress bar are imported inside the
command, so registering it costs nothing to the client commands.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from weaved.cli.fmt import printable

HELP = (
    "Convert a GGUF model into Weave's shared weight format.\n\n"
    "The shared format is a normal GGUF file that both of Weave's backends (CPU and GPU) compute on "
    "directly, and that llama.cpp loads too: every 2-D weight matrix is Q4_0 (blocks of 32 weights: an "
    "fp16 scale and 4-bit values); the token embedding and output matrices are Q8_0 (or stay Q4_0 if "
    "they already are); norms and biases are float32. Metadata (tokenizer, chat template, "
    "hyper-parameters) is copied unchanged.\n\n"
    "Sources may be of any quantization gguf-py reads (Q4_1, Q4_K, Q5_K, Q6_K, Q8_0, F16, BF16, F32 ...); "
    "architectures: llama (Mixtral-style experts too), qwen2, qwen3, qwen3moe, gemma3. `weave serve --model X` "
    "converts a model that needs it by itself (once, into the cache); this command writes the converted file "
    "where you choose."
)


def _fail(message: str, code: int = 1) -> typer.Exit:
    """``weave: error: ...``; exit 2 for bad usage (the arguments), 1 when the conversion fails."""
    typer.echo(printable(f"weave: error: {message}"), err=True)  # (it may quote a file's metadata)
    return typer.Exit(code)


def register(app: typer.Typer) -> None:
    """Add ``convert`` to ``app``."""

    @app.command("convert", help=HELP)
    def convert(
        src: Annotated[Path, typer.Argument(metavar="IN", help="GGUF model to convert.", show_default=False)],
        dst: Annotated[Path, typer.Argument(metavar="OUT", help="Where to write the converted GGUF.",
                                            show_default=False)],
        force: Annotated[bool, typer.Option("--force", "-f", help="Overwrite OUT if it exists.")] = False,
    ) -> None:
        if not src.exists():
            raise _fail(f"input file not found: {src}", 2)
        if src.is_dir():
            raise _fail(f"input is a directory, not a GGUF file: {src}", 2)
        if dst.is_dir():
            raise _fail(f"{dst} is a directory: name the file to write (e.g. {dst / src.name})", 2)
        if dst.parent.exists() and not dst.parent.is_dir():
            raise _fail(f"cannot write {dst}: {dst.parent} is a file, not a directory", 2)
        if dst.exists() and not force:
            raise _fail(f"{dst} already exists; pass --force to overwrite it", 2)

        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        from weaved.model.convert import ConversionStats, convert_gguf
        from weaved.model.default import check_model_layout

        columns = (TextColumn("converting"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("{task.description}"))
        err = Console(stderr=True)  # (a bar only on a terminal: on a pipe it would leave a blank line)
        with Progress(*columns, console=err, transient=True, disable=not err.is_terminal) as bar:
            task = bar.add_task("", total=None)

            def progress(done: int, total: int, name: str) -> None:
                bar.update(task, completed=done, total=total, description=name)

            stats = ConversionStats()
            try:
                check_model_layout(src)  # (a file the engine would refuse once converted is refused now)
                out = convert_gguf(src, dst, force=force, progress=progress, stats=stats)
            except FileExistsError:
                raise _fail(f"{dst} already exists; pass --force to overwrite it") from None
            except ValueError as exc:  # (not a GGUF Weave runs: a bad input, as a missing one is)
                raise _fail(str(exc), 2) from None
            except OSError as exc:
                raise _fail(_os_error(exc, src, dst)) from None
        typer.echo(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB); {stats.describe()}")


def _os_error(exc: OSError, src: Path, dst: Path) -> str:
    """An OSError in words: the file it concerns (OUT for its temporary file beside it) and why."""
    why = exc.strerror or str(exc)
    name = Path(exc.filename) if exc.filename else None
    if name is None or name.parent == dst.parent:
        return f"cannot write {dst}: {why}"
    return f"cannot read {src}: {why}" if name == src else f"{name}: {why}"
