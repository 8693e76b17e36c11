"""``python -m undolog_core.cli``: the ``undolog`` command without the console script."""

from . import main

main()
