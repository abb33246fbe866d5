"""Inference backends behind the proxy: `local` (embedded transformers engine)."""
