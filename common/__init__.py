"""What every layer shares: configs and one-line errors of commands, experiment tracking, the stdlib corpus,
figures."""

from common.clash import refuse_import_name_clashes

refuse_import_name_clashes()  # every package and command of ours imports common first
