"""The performance model (map: to be written)."""
