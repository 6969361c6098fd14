"""The worker role."""
