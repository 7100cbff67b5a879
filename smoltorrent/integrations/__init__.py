"""smoltorrent inside the training frameworks people already use: each module here is one
framework's hook (smoltorrent.integrations.lightning: a Lightning CheckpointIO plugin;
smoltorrent.integrations.transformers: a Hugging Face TrainerCallback).

A module imports its framework, so nothing here is imported by smoltorrent itself, and
nothing on the store or gather path imports it.
"""
