"""splitserve.v1 messages and services, generated from proto/splitserve/v1/*.proto by proto/generate.py."""
