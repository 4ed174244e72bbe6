"""splitserve.v1 messages and services, generated from the .proto files beside this file."""
