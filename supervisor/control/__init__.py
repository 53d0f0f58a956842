"""The control API (the unix socket, and TCP with a token) and its event stream."""
