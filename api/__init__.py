"""FastAPI apps: the control plane (localhost) and the peer plane (network).

Only this package turns ``atomd.errors`` into HTTP responses.
"""
