"""Generated protobuf and gRPC code. Do not edit."""
