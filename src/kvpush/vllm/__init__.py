"""kvpush's KV transfer protocol inside vLLM: a v1 KV connector (docs/VLLM.md).

``vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvpushConnector",
"kv_connector_module_path": "kvpush.vllm", "kv_role": "kv_producer", ...}'``. vLLM is
imported here only when vLLM loads the connector (``pip install kvpush[vllm]``);
``settings.py``, ``region.py``, ``plan.py`` and ``worker.py`` do not import it.
"""

from __future__ import annotations


def __getattr__(name: str):
    if name == "KvpushConnector":
        from kvpush.vllm.connector import KvpushConnector

        return KvpushConnector
    raise AttributeError(name)
