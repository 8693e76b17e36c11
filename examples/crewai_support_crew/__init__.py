"""Customer-support crew guarded by UndoLog (CrewAI), runnable offline: ``python -m examples.crewai_support_crew``."""
