"""Operator tools run from the command line (``python -m gateway.tools.<name>``)."""
