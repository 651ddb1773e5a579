"""What the router, the workers, the controller and the SDK share on the wire and around it.

The .proto sources and their committed generated stubs (tandem/v1/: tandem.proto the public API,
worker.proto router and workers, admin.proto the controller to the router), and the pieces every
side of those protocols imports one definition of: the cluster secret (auth.py), the limits
(limits.py), the one-stream-many-requests machinery (streams.py), grpc's I/O path (grpc_io.py)
and the server processes' start-up (process.py). Never imports torch or another Tandem package
(docs/architecture.md#packages-and-import-direction).
"""
