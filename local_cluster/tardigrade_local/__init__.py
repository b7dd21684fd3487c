"""A local Kubernetes for development and tests: API server, process kubelet, GCS emulator."""
