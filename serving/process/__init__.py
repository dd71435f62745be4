"""One server process (app: its ports, lifecycle and drain), several on one port (workers), and the memory a process
gives back to the system after a burst (memory)."""
