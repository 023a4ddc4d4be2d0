"""One host copy per machine: a host tier that several daemons share (issue #28).

    owner   SharedHostOwner: holds the blocks (sealed memfd segments), one budget,
            one eviction policy, and the leases of every attached process
    wire    the messages on the owner's Unix socket and their validation
    blocks  one block: create, fill once from the store (checksummed), seal, map
    policy  which unleased block to drop: Belady on the attached traces, else LRU
    client  a daemon's side: the connection, acquire/release, grants (copy or map)
    loads   the backend's load seam: batched acquires, mapped leases, parked mappings

Imports point one way: loads -> client -> wire, blocks; owner -> wire, blocks, policy.
Nothing here imports the daemon; the daemon's backend imports `loads` only when the
`shared_host` config key is set (docs/shared-host.md).
"""
