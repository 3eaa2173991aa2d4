"""What the transfer layer reports: one record per finished transfer, and its counters."""

from __future__ import annotations

import msgspec


class TransferRecord(msgspec.Struct):
    """One finished transfer, for /metrics and logs (sent to the front end with outputs)."""

    transfer_id: str
    role: str
    mode: str
    ok: bool
    num_bytes: int = 0
    num_descriptors: int = 0
    post_s: float = 0.0
    transfer_s: float = 0.0
    error: str | None = None


class TransferCounters(msgspec.Struct):
    """The transfer thread's counters (it alone writes them; the step loop gets a copy and
    adds the gauges of what it holds)."""

    transfers_ok: int = 0
    transfers_failed: int = 0
    leases_expired: int = 0
    aborts_sent: int = 0  # a fence's repeats are not counted
    aborts_received: int = 0
    messages_bad: int = 0
    fences: int = 0
    fences_peer_gone: int = 0
    fence_timeouts: int = 0
    writes_refused: int = 0  # blocks stated computed for a transfer already ended
    registrations_after_blocks: int = 0
    digest_mismatches: int = 0  # --kv-digest: receives whose KV failed the check
    #: by reason / state (the side channel's and the peer table's figures)
    side_channel_rejected: dict[str, int] = {}
    side_channel_send_dropped: dict[str, int] = {}
    side_channel_peers_evicted: dict[str, int] = {}
    side_channel_peers: dict[str, int] = {}
    # gauges of the step loop
    sends_in_flight: int = 0
    recvs_in_flight: int = 0
    blocks_lent: int = 0
    blocks_fenced: int = 0

    def copy(self) -> TransferCounters:
        return msgspec.structs.replace(
            self, side_channel_rejected=dict(self.side_channel_rejected),
            side_channel_send_dropped=dict(self.side_channel_send_dropped),
            side_channel_peers_evicted=dict(self.side_channel_peers_evicted),
            side_channel_peers=dict(self.side_channel_peers))
