"""What both worker roles share to become serving processes: worker config, proto conversion,
Prometheus metrics, the gRPC server with health and reflection, and the engine thread.

Runs inside prefill and decode worker processes; imports protos (the control plane) and
nothing of the roles themselves.
"""
