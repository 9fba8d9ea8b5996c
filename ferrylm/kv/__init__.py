"""KV cache: paged block allocation with prefix caching, and per-sequence non-KV state slots."""
