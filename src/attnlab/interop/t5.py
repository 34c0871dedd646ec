"""T5 converter: filled in below."""
