"""MegaCapybara's engine: many agents on one model, one GPU, one unified KV budget."""

__version__ = "0.1.0"
