"""Benchmarks and studies: commands that measure the library against peers and engines (they may import
train, inference and speculators; nothing imports them)."""
