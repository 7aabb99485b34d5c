"""Model modules the bad-input cases build or copy into a temporary directory."""
