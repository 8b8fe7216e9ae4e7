"""corral proxy: the OpenAI-compatible HTTP front."""
