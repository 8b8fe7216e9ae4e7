"""corral supervisor: child processes, memory, policy."""
