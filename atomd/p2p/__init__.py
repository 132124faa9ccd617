"""The peer-to-peer layer: peer identity, signed peer-plane requests, membership, discovery."""
