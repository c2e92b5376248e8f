"""runtime/checkpointing."""
