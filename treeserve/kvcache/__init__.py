"""treeserve.kvcache."""
