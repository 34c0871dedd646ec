"""Analysis tools: attention statistics (and, as they grow, cost models and diagnostics)."""
