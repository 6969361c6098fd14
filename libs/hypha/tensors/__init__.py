"""Tensor payloads (safetensors bytes) and their chunked streaming.

``hypha.tensors.payload`` turns state dicts into bytes and back, checked
against a template (it needs torch: the ``hypha-ml[torch]`` extra);
``hypha.tensors.chunks`` cuts bytes into bounded ``hypha.v1.Chunk`` messages
and verifies them on the way back in (no torch).

NOTE: nothing is re-exported here, so importing ``hypha.tensors.chunks`` (the
scheduler and gateway do) never loads torch.
"""
