"""The host-facing layer: starting engine processes (exec and the fork-server client), watching
their exits by pidfd, reaping what they leave behind, the guard that outlives a SIGKILLed
daemon, per-incarnation scratch directories, the file-descriptor reserve, the kernel's OOM
evidence, GPU memory release (NVML) and the runtime directory and its lock. Nothing here decides
lifecycle; the lifecycle layer (replica, groups, fleet) calls in."""
