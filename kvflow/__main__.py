"""``python -m kvflow``: the ``kvflow`` command."""

from ._cli import main

raise SystemExit(main())
