"""Drafter models (one file per family), the frozen target wrapper, draft vocabularies and serving formats."""

import common  # noqa: F401  refuses, in one line, an environment where vLLM's speculators shares this import name
