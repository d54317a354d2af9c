"""treeserve.models."""
