"""Generated gRPC stubs of splitserve's protos (package splitserve.v1); see proto/generate.py."""
