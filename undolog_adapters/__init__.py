"""Framework adapters for UndoLog. Each module imports its framework lazily."""
