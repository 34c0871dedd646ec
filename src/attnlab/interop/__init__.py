"""Interoperability: Hugging Face conversion and checkpoints."""
