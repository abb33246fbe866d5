"""Trace store (SQLite), importers and tokenization."""
