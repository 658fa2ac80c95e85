"""One module per pipeline variant."""
