"""The data role."""
