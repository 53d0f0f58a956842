"""A cluster gateway (`upstreams:` instead of `engines:`): engined's gateway in front of the
engined gateways of other nodes, with no engines of its own and no membership of its own.
`nodes`: membership (what the listed names resolve to) and each node's health and load (its
model server protocol, probed); `router`: the gateway's router over the up nodes (the Routes
that the engine router implements over replicas); `services`: the daemon's services composed
for it (its gateway routed over nodes, the probes, readiness from the nodes, a reload's new
node list)."""
