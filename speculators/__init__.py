"""Drafter models (one file per family), the frozen target wrapper, draft vocabularies and serving formats."""
