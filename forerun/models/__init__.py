"""Models: finding and loading weights (GGUF, Hugging Face folders, the embedded pair), the lean
decoder with row-exact attention, the numeric formats, tokenizers, the KV cache and the prefix cache."""
