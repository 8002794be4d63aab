"""distribute."""
