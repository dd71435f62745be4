"""One server process (app: its ports, lifecycle and drain) and several on one port (workers)."""
