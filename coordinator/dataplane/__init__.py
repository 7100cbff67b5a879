"""Bytes to and from storage nodes: the node client and the store and gather engines."""
