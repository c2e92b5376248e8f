"""Native extensions of spillover; import the public modules instead."""
