"""Adapters, one per kind of child server."""
