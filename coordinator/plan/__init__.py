"""What a checkpoint becomes (pure; reads only the header).

safetensors header, shard plan, placement, manifest, source identity.
"""
