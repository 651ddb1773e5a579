"""What both worker roles share to become serving processes: worker config, proto conversion,
Prometheus metrics, the gRPC server with health and reflection, the engine thread, the session
state of a role's servicer, and the ops rank 0 mirrors on a TP replica's other ranks (tp_role).

Runs inside prefill and decode worker processes. Imports engine (through ``LLMEngine``'s own API),
kvtransfer and protos, and nothing of the roles themselves (docs/architecture.md#packages-and-import-direction).
"""
