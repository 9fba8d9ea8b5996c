"""Checkpoint readers: safetensors directories, GGUF files and ferry stores behind one `WeightSource`
interface (`source.py`). They know files and formats, not models or devices."""
