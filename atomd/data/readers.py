"""Document datasets (JSON lines, Parquet, a ``datasets`` folder saved with ``save_to_disk``),
tokenized once into a memory-mapped token cache next to the data.

A source's documents (the ``text_field`` of each record) are tokenized in batches and streamed
to ``<cache>/tokens-<key>.bin`` (uint16, or uint32 for vocabularies over 65,536), documents
separated by the tokenizer's ``<|endoftext|>`` when it has one, else by a blank line. The key
hashes the tokenizer, the text field and each input file's name, size and modification time,
so a changed file or another tokenizer makes a new cache. Training maps the file
(``np.memmap``): the corpus is never held in memory. Beside it, ``tokens-<key>.json`` records
the token count and the sha256 of the tokens (the content hash a job spec's ``data_sha256``
names). The cache goes to ``<data>.atomd-cache/``
(a folder source: ``<folder>/.atomd-cache/``), or under ``$XDG_CACHE_HOME/atomd/tokens`` where
the data's folder is read-only.

pyarrow reads Parquet and the Arrow files of a ``save_to_disk`` folder (the ``datasets``
library itself is not needed to read them).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from atomd.data.tokenizer import END_OF_TEXT, BPETokenizer, TokenArray, Tokenizer, token_dtype
from atomd.errors import ConfigError, DataError
from atomd.logs import get_logger

log = get_logger(__name__)

JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIX = ".parquet"
_DOCS_PER_BATCH = 512


@dataclass(frozen=True)
class DocumentSource:
    """The files of a document dataset, in reading order, and their kind."""

    kind: str  # "jsonl" | "parquet" | "arrow"
    files: tuple[Path, ...]
    root: Path


def document_source(path: Path) -> DocumentSource | None:
    """The document dataset at ``path``, or None when it is not one (text, .bin, ...)."""
    if path.is_file():
        if path.suffix in JSONL_SUFFIXES:
            return DocumentSource("jsonl", (path,), path)
        if path.suffix == PARQUET_SUFFIX:
            return DocumentSource("parquet", (path,), path)
        return None
    if not path.is_dir():
        return None
    if (path / "dataset_dict.json").is_file():  # a DatasetDict: its train split
        split = path / "train"
        if not (split / "state.json").is_file():
            raise DataError(f"{path} is a saved DatasetDict without a 'train' split")
        path = split
    if (path / "state.json").is_file():
        state = json.loads((path / "state.json").read_text())
        files = tuple(path / f["filename"] for f in state.get("_data_files", []))
        if not files:
            raise DataError(f"{path}/state.json lists no data files")
        return DocumentSource("arrow", files, path)
    parquet = tuple(sorted(p for p in path.rglob(f"*{PARQUET_SUFFIX}") if p.is_file()))
    if parquet:
        return DocumentSource("parquet", parquet, path)
    jsonl = tuple(sorted(p for p in path.rglob("*") if p.suffix in JSONL_SUFFIXES))
    if jsonl:
        return DocumentSource("jsonl", jsonl, path)
    return None


def _jsonl_texts(path: Path, field: str) -> Iterator[str]:
    with path.open("rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not JSON ({e.msg})") from None
            if not isinstance(record, dict) or field not in record:
                raise DataError(f"{path}:{n}: no {field!r} field (set the job's text_field)")
            text = record[field]
            if not isinstance(text, str):
                raise DataError(f"{path}:{n}: {field!r} is {type(text).__name__}, not text")
            yield text


def _arrow_texts(batches: Iterator[Any], field: str, path: Path) -> Iterator[str]:
    for batch in batches:
        if field not in batch.schema.names:
            raise DataError(
                f"{path}: no column {field!r} (columns: {', '.join(batch.schema.names)}; set the "
                "job's text_field)"
            )
        for text in batch.column(field).to_pylist():
            if text is not None:
                yield str(text)


def documents(source: DocumentSource, field: str) -> Iterator[str]:
    """Every document's text, in order."""
    for path in source.files:
        if source.kind == "jsonl":
            yield from _jsonl_texts(path, field)
            continue
        try:  # the optional "data" extra, imported by name only for these sources
            pa = importlib.import_module("pyarrow")
            pq = importlib.import_module("pyarrow.parquet")
        except ImportError:
            raise ConfigError(
                f"{path}: reading {source.kind} data needs pyarrow (pip install 'atomd[data]')"
            ) from None
        try:
            if source.kind == "parquet":
                yield from _arrow_texts(pq.ParquetFile(path).iter_batches(columns=[field]), field,
                                        path)  # fmt: skip
            else:  # save_to_disk writes Arrow IPC streams
                with pa.memory_map(str(path)) as mm:
                    yield from _arrow_texts(iter(pa.ipc.open_stream(mm)), field, path)
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{path}: cannot be read: {e}") from None


def cache_key(source: DocumentSource, tok: Tokenizer, field: str) -> str:
    h = hashlib.sha256()
    h.update(tok.to_json().encode())
    h.update(f"\0{field}\0{source.kind}\0".encode())
    for f in source.files:
        st = f.stat()
        h.update(f"{f.relative_to(source.root) if f != source.root else f.name}\0".encode())
        h.update(f"{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return h.hexdigest()[:20]


def _cache_dirs(source: DocumentSource) -> list[Path]:
    near = (
        source.root / ".atomd-cache"
        if source.root.is_dir()
        else source.root.with_name(source.root.name + ".atomd-cache")
    )
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "atomd" / "tokens"
    return [near, home]


@dataclass(frozen=True)
class TokenCache:
    path: Path
    tokens: int
    sha256: str
    dtype: str = "uint16"

    def array(self) -> TokenArray:
        if self.tokens == 0:
            return np.zeros(0, dtype=self.dtype)
        out: TokenArray = np.memmap(self.path, dtype=self.dtype, mode="r")
        return out


def _read_meta(meta_path: Path, bin_path: Path) -> TokenCache | None:
    try:
        meta = json.loads(meta_path.read_text())
        dtype = np.dtype(meta["dtype"])
        if dtype not in (np.uint16, np.uint32):
            return None
        if bin_path.stat().st_size != dtype.itemsize * int(meta["tokens"]):
            return None
        return TokenCache(bin_path, int(meta["tokens"]), str(meta["sha256"]), dtype.name)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def token_cache(source: DocumentSource, tok: Tokenizer, field: str = "text") -> TokenCache:
    """The source's tokens, from the cache, or tokenized into it first (streaming)."""
    key = cache_key(source, tok, field)
    for folder in _cache_dirs(source):
        found = _read_meta(folder / f"tokens-{key}.json", folder / f"tokens-{key}.bin")
        if found is not None:
            return found
    problems = []
    for folder in _cache_dirs(source):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            return _write_cache(source, tok, field, folder, key)
        except PermissionError as e:
            problems.append(f"{folder}: {e.strerror}")
    raise DataError(f"no writable place for the token cache of {source.root}: {problems}")


def _separator(tok: Tokenizer) -> list[int]:
    if isinstance(tok, BPETokenizer):
        eot = tok.tok.token_to_id(END_OF_TEXT)
        if eot is not None:
            return [int(eot)]
    return tok.encode("\n\n")


def _write_cache(
    source: DocumentSource, tok: Tokenizer, field: str, folder: Path, key: str
) -> TokenCache:
    final = folder / f"tokens-{key}.bin"
    tmp = folder / f".tokens-{key}.{os.getpid()}.tmp"
    dtype = np.dtype(token_dtype(tok.vocab_size))
    sep = np.asarray(_separator(tok), dtype=dtype)
    digest = hashlib.sha256()
    count, docs = 0, 0

    def flush(batch: list[str], f: Any) -> int:
        arrays: list[TokenArray] = []
        for text in batch:
            if count or arrays:
                arrays.append(sep)
            arrays.append(tok.encode_array(text.encode("utf-8")))
        blob = np.concatenate(arrays).astype(dtype).tobytes() if arrays else b""
        f.write(blob)
        digest.update(blob)
        return len(blob) // dtype.itemsize

    log.info("tokenizing %s into %s", source.root, final)
    try:
        with tmp.open("wb") as f:
            batch: list[str] = []
            for text in documents(source, field):
                batch.append(text)
                docs += 1
                if len(batch) >= _DOCS_PER_BATCH:
                    count += flush(batch, f)
                    batch = []
            count += flush(batch, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    meta = {
        "tokens": count,
        "documents": docs,
        "dtype": dtype.name,
        "sha256": digest.hexdigest(),
        "tokenizer": tok.name,
        "text_field": field,
        "source": str(source.root),
        "files": [str(f) for f in source.files],
    }
    (folder / f"tokens-{key}.json").write_text(json.dumps(meta, indent=2) + "\n")
    log.info("%s: %d documents, %d tokens", source.root, docs, count)
    return TokenCache(final, count, digest.hexdigest(), dtype.name)


def tokens_sha256(*parts: TokenArray) -> str:
    """The content hash of a token stream (its parts in order, as the bytes of their dtype:
    uint16, or uint32 for vocabularies over 65,536)."""
    h = hashlib.sha256()
    for p in parts:
        for i in range(0, len(p), 1 << 24):  # memory-mapped data in pieces
            h.update(np.ascontiguousarray(p[i : i + (1 << 24)]).tobytes())
    return h.hexdigest()
