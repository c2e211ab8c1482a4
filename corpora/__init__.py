"""Corpus recipes (see corpora/README.md)."""
