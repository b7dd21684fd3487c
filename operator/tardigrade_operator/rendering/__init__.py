"""Render: the manifests of a job's children (pods, Service, NetworkPolicy, keys Secret) from
its spec. Pure."""
