"""Model files: GGUF loading, conversion to the shared Q4_0 format, architectures, tokenizer."""
