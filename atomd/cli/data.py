"""``atomd data ...`` and ``atomd tokenizer ...``: datasets and tokenizers, before a job."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from atomd.cli.common import fail

data_app = typer.Typer(
    help="Datasets: tokenize once into the token cache, print the content hash.",
    no_args_is_help=True,
    rich_markup_mode=None,
)


@data_app.command("prepare")
def data_prepare(
    data: Annotated[
        str,
        typer.Argument(
            help="'shakespeare', a text file or folder, .bin tokens, a .jsonl file, Parquet "
            "file(s) or a folder saved by datasets' save_to_disk."
        ),
    ],
    tokenizer: Annotated[
        str, typer.Option(help="bytes, default or a tokenizer.json, as the job will use.")
    ] = "bytes",
    text_field: Annotated[
        str, typer.Option(help="The field or column holding each document's text.")
    ] = "text",
) -> None:
    """Tokenize a dataset as a job would (documents go to a memory-mapped token cache next to
    the data) and print its token count and content hash, the job spec's data_sha256: every
    peer then checks its own copy against it."""
    from atomd.data.dataset import load_source, stream_sha256
    from atomd.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer)
    tokens, val, sha = load_source(data, tok, text_field)
    parts = [tokens] if val is None else [tokens, val]
    n = sum(len(p) for p in parts)
    largest = max((int(p.max()) for p in parts if len(p)), default=0)
    typer.echo(f"{data}: {n:,} tokens (tokenizer {tokenizer}, largest id {largest:,})")
    typer.echo(f"data_sha256: {stream_sha256(tokens, val, sha)}")


tokenizer_app = typer.Typer(
    help="Byte-level BPE tokenizers (Hugging Face tokenizers, offline).",
    no_args_is_help=True,
    rich_markup_mode=None,
)


@tokenizer_app.command("train")
def tokenizer_train(
    corpus: Annotated[
        list[Path],
        typer.Argument(help="Text files or folders (their .txt/.md files, in sorted order)."),
    ],
    vocab_size: Annotated[
        int, typer.Option(help="Tokens in the vocabulary: <|endoftext|>, 256 bytes, merges.")
    ] = 4096,
    min_frequency: Annotated[int, typer.Option(help="Merge pairs seen at least this often.")] = 2,
    out: Annotated[Path, typer.Option(help="The tokenizer.json to write.")] = Path(
        "tokenizer.json"
    ),
) -> None:
    """Fit a byte-level BPE (GPT-2's pre-tokenizer) on a corpus; a job uses it with
    "tokenizer": "PATH" and "vocab_size" of at least its size."""
    from atomd.data.tokenizer import BPETokenizer, train_bpe

    files: list[Path] = []
    for c in corpus:
        if c.is_dir():
            files += sorted(p for p in c.rglob("*") if p.is_file() and p.suffix in (".txt", ".md"))
        elif c.is_file():
            files.append(c)
        else:
            fail(f"{c}: no such file or folder")
    if not files:
        fail("no .txt/.md files in the corpus given")
    tok = train_bpe(files, vocab_size=vocab_size, min_frequency=min_frequency)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    bpe = BPETokenizer(tok, name=str(out))
    size = sum(f.stat().st_size for f in files)
    n = sum(len(bpe.encode_array(f.read_bytes())) for f in files)
    typer.echo(
        f"wrote {out}: {bpe.vocab_size} tokens, fitted on {len(files)} file(s) of {size:,} "
        f"bytes ({size / max(n, 1):.2f} bytes per token on them)"
    )
