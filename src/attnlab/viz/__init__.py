"""Pictures of attention (matplotlib, the ``viz`` extra)."""
