"""``psyswarm tokenize`` (text, JSONL or Parquet → token files) and ``psyswarm train-tokenizer`` (a small BPE
trained here on the embedded corpus, so that an example needs no download)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

DEFAULT_SHARD_TOKENS = 1 << 27  # client.data.tokenize.DEFAULT_SHARD_TOKENS, here so that --help stays fast


def _fail(message: str) -> typer.Exit:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(1)


def tokenize(
    inputs: Annotated[list[Path], typer.Argument(
        metavar="INPUT", help="Text, JSONL or Parquet files, directories of them, or 'stdlib' (the embedded corpus).")],
    output: Annotated[Path, typer.Option(help="Directory to create: token files and their dataset.json.")],
    tokenizer: Annotated[str, typer.Option(help="'bytes', or a tokenizer.json or a model directory holding one.")]
    = "bytes",
    format: Annotated[str | None, typer.Option(help="text | jsonl | parquet (default: from the files' suffix).")]
    = None,
    text_field: Annotated[str, typer.Option(help="The field holding each document's text (JSONL, Parquet).")]
    = "text",
    dtype: Annotated[str, typer.Option(help="auto | uint16 | uint32 (auto: the smallest that holds the vocabulary).")]
    = "auto",
    shard_tokens: Annotated[int, typer.Option(help="Tokens per file at most.")] = DEFAULT_SHARD_TOKENS,
) -> None:
    """Turn documents into token files addressed by sample index, ending each with the tokenizer's EOS."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from client.data import DatasetError, load_tokenizer
    from client.data.tokenize import tokenize_files

    progress = Progress(TextColumn("tokenizing"), BarColumn(), MofNCompleteColumn(), TextColumn("documents"),
                        TextColumn("{task.fields[tokens]:,} tokens"), TimeElapsedColumn(),
                        console=Console(stderr=True))
    task = progress.add_task("tokenize", total=None, tokens=0)

    def begin(documents: int) -> None:  # once the inputs, the tokenizer and the output are known to be usable
        progress.update(task, total=documents)
        progress.start()

    try:
        loaded = load_tokenizer(tokenizer)
        try:
            summary = tokenize_files(
                inputs, loaded, output, fmt=format, text_field=text_field, dtype=dtype, shard_tokens=shard_tokens,
                total_hint=begin, on_progress=lambda done, tokens: progress.update(task, completed=done, tokens=tokens))
        finally:
            progress.stop()
    except (DatasetError, OSError) as exc:
        raise _fail(str(exc)) from None
    except KeyboardInterrupt:
        raise _fail("interrupted: nothing written") from None
    typer.echo(f"{summary.tokens:,} tokens from {summary.documents:,} documents in {summary.files} "
               f"{summary.sidecar.dtype} files at {summary.tokens_per_second:,.0f} tokens/s -> {output} "
               f"(tokenizer {summary.sidecar.tokenizer_name}, sha256 {summary.sidecar.tokenizer_sha256})")


def train_tokenizer(
    output: Annotated[Path, typer.Option(help="Directory to write tokenizer.json and tokenizer_config.json into.")],
    vocab: Annotated[int, typer.Option(help="Vocabulary size, special tokens included.")] = 4096,
    max_bytes: Annotated[int | None, typer.Option(help="Train on about this many bytes of the corpus.")] = None,
) -> None:
    """Train a byte-level BPE tokenizer on the embedded corpus (the Python standard library's sources)."""
    from client.data import DatasetError, tokenizer_sha256
    from client.data.tokenizer import stdlib_texts, train_bpe

    try:
        path = train_bpe(output.expanduser(), vocab, stdlib_texts(max_bytes))
    except (DatasetError, OSError) as exc:
        raise _fail(str(exc)) from None
    typer.echo(f"tokenizer with {vocab:,} tokens -> {path} (sha256 {tokenizer_sha256(path).hex()})")


def register(app: typer.Typer) -> None:
    app.command("tokenize")(tokenize)
    app.command("train-tokenizer")(train_tokenizer)
