"""Where model weights come from: checkpoint dirs, GGUF files, random init, the SmolLM2 default."""
