"""Customer-support agent guarded by UndoLog (Semantic Kernel), runnable offline: ``python -m examples.semantic_kernel_support``."""
