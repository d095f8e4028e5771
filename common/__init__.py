"""What every layer shares: configs and one-line errors of commands, experiment tracking, the stdlib corpus,
figures."""
