"""Test helpers shared by several test modules (importable in rank processes: tests/ is on sys.path)."""
