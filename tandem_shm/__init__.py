"""The KV pool's leaf: its shared-memory files (pools.py) and its geometry (geometry.py); below
engine and kvtransfer, standard library only.

A leaf package so that engine (which creates a CPU worker's pool), kvtransfer (which maps another
process's pool and makes pools for its tests) and the launchers (which remove a dead child's
pools) hold one definition of the pool directory, the pool names and how a pool is made, and
engine's ``KVPoolShape`` and kvtransfer's ``KVLayout`` one definition of a pool's sizes and byte
offsets, though engine and kvtransfer may not import each other
(docs/architecture.md#packages-and-import-direction).
"""
