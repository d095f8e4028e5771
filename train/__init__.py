"""Training: Lightning modules, data, recipes."""
