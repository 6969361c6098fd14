"""The client role."""
