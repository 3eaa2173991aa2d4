"""A whole cluster on one host: `kvpush up` starts prefill and decode instances and the
router as supervised child processes (:mod:`kvpush.cluster.launcher`)."""
