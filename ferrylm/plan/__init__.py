"""Memory and placement planning: sizes of weights, KV and per-sequence state, computed from configs."""
