"""Tensor parallelism: the ranks of one replica as processes.

- ``group``: the rank group (torch.distributed over one TCPStore hosted by rank 0) and rank 0's
  ``Leader``, which broadcasts each step and control message to the followers.
- ``follower``: a rank > 0's process, ``python -m engine.tp.follower``; it runs the same forward
  as rank 0 and takes a role's ``FollowerHooks`` for what the role adds to a step.
- ``spawn``: ``LocalFollowers``, the follower processes an ``LLM`` on one machine starts itself.

Runs in every rank process. Imports engine modules (config, model runner), never a worker role.
"""
