"""runtime/network/tcp."""
