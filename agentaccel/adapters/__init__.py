"""Glue for agent frameworks pointed at the proxy."""
