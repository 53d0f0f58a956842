"""What engined shows of itself: Prometheus metrics, the /metrics and health endpoint, resource
sampling and systemd's notify protocol."""
