"""Cost models: compute (FLOPs, MFU), memory, and the network (alpha-beta, scaling)."""
