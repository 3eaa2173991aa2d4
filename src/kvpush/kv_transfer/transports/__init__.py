"""Transports that move KV blocks: the interface and NIXL."""
