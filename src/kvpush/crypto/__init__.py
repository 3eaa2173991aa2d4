"""Keys derived from the cluster secret and what they sign: grants on
``kv_transfer_params`` and the side channel's message MACs (``auth.py``), CURVE keys
and the ZAP guard (``curve.py``). Below every package that uses them; imports only
``kvpush.errors``."""
