"""The gateway role."""
