"""Which server serves a request. `routes`: the protocol the gateway routes through and what
every router shares (admission, load, the pick-and-wait loop); `replicas`: the engine router,
over the fleet's replicas (the gateway, the control socket's generate, rolling restarts). The
other router, over a cluster gateway's node gateways, lives with the nodes it reads
(supervisor.cluster.router)."""
