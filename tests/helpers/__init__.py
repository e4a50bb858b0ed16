"""Helpers shared by the test modules of both suites (no tests here: pytest collects ``test_*.py`` only)."""
