"""The transfer thread: peers, posted transfers, leases, fences (see ``kvpush.kv_transfer``)."""
