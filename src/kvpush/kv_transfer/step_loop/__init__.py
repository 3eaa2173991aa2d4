"""The step loop's side of KV transfer (see ``kvpush.kv_transfer``)."""
