"""runtime/network."""
