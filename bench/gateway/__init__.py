"""Gateway benchmark: what the OpenAI-compatible gateway costs against the engine driven
directly, and how many requests an engine kill costs through it (`python -m bench.gateway`;
bench/README.md).

- `__main__`: the run, the summary of the targets and the method;
- `paths`: the four paths a request takes (direct over ZeroMQ and the gateway, streamed and
  not), the direct engines and the daemon;
- `overhead`: the gateway's cost and time to first token;
- `failover`: requests lost per engine kill, through the gateway and the control socket.
"""
