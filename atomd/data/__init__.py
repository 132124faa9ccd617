"""Data: the bundled corpus, the byte-level tokenizer, datasets, splits and shards.

``atomd.data.sources`` needs neither torch nor numpy; the dataset modules load them.
"""
