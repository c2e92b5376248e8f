"""runtime/recovery."""
