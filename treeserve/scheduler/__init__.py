"""treeserve.scheduler."""
