"""``python -m treeserve ...``: the same CLI as the ``treeserve`` script."""

from treeserve.cli import main

raise SystemExit(main())
