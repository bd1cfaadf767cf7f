"""``python -m services.cli``: the ``headrace`` command without its console script."""

from services.cli.cli import main

main()
