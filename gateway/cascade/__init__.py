"""Routing: which engine tier serves a turn."""
