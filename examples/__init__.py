"""Runnable examples (offline, scripted models)."""
