"""KV transfer: transports (NIXL, in-process), side channel, fault injection, protocols."""
