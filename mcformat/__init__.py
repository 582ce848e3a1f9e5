"""MC weights: GGUF files plus `mc.*` quality metadata, their builder and evaluation."""
