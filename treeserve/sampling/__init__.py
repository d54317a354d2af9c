"""treeserve.sampling."""
