"""atomd: a peer-to-peer training daemon for large language models (ATOM, arXiv 2403.10504)."""

__version__ = "0.1.0"
