"""Corpora maxtrain builds itself (maxtrain/data reads corpora; this makes one): the offline
default corpus of `data.sources: embedded` (embedded.py)."""
