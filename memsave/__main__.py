"""``python -m memsave``: the ``memsave`` command."""

from memsave.cli import main

raise SystemExit(main())
