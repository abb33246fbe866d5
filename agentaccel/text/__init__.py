"""Text shared by the trace store and every backend: tokenizers (`tokenization`), chat messages
as plain text and canonical JSON (`messages`), and prompts rendered with a chat template
(`render`). Imports nothing of ours but the asset locations."""
