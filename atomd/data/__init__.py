"""Data: the bundled corpus, the byte-level tokenizer, datasets, splits and shards."""

from atomd.data.dataset import Batch, TokenDataset, load_dataset
from atomd.data.tokenizer import ByteTokenizer

__all__ = ["Batch", "ByteTokenizer", "TokenDataset", "load_dataset"]
