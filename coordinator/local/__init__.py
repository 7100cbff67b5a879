"""The embedded cluster on one machine: node and worker processes, demo, checkpoints."""
