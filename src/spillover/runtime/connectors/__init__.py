"""runtime/connectors."""
