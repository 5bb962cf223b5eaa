"""The process side: the server's start and stop, worker processes on one port, draining."""
