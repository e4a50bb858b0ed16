"""Bundled benchmark prompts (see SOURCES.md beside this file for origin, commit and license)."""
