"""Rebuild the packaged default tokenizer ``atomd/data/tokenizer-shakespeare-4096.json``.

A byte-level BPE (GPT-2's pre-tokenizer and byte alphabet, ``<|endoftext|>`` as id 0, then the
256 byte symbols, then 3,839 merges) fitted with Hugging Face ``tokenizers`` on the training
part of the bundled corpus (its first 95%: the validation tail stays unseen, as
``val_fraction`` 0.05 holds it out), minimum pair frequency 2. The same as::

    atomd tokenizer train --vocab-size 4096 shakespeare-train.md --out tokenizer.json

Run ``python scripts/build_tokenizer.py``; fitting is deterministic, so the file only changes
when the corpus, ``tokenizers`` or these settings do.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from atomd.data.dataset import bundled_text
from atomd.data.tokenizer import DEFAULT_FILE, BPETokenizer, train_bpe

VOCAB = 4096
OUT = Path(__file__).resolve().parents[1] / "atomd" / "data" / DEFAULT_FILE


def main() -> None:
    text = bundled_text()
    train = text[: int(len(text) * 0.95)]
    with tempfile.TemporaryDirectory() as d:
        corpus = Path(d) / "shakespeare-train.md"
        corpus.write_bytes(train)
        tok = train_bpe([corpus], vocab_size=VOCAB, min_frequency=2)
    OUT.write_text(tok.to_str(), encoding="utf-8")
    n = len(BPETokenizer(tok, name="default").encode_array(text))
    print(
        f"{OUT}: {tok.get_vocab_size()} tokens, {OUT.stat().st_size:,} bytes; the corpus "
        f"({len(text):,} bytes) is {n:,} tokens ({len(text) / n:.2f} bytes per token)"
    )


if __name__ == "__main__":
    main()
