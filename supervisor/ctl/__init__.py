"""enginectl: the command line, its client of the control socket, its tables and its shell
completion."""
