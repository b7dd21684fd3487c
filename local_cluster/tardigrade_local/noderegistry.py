"""A real node's way to the cluster's image registry, under the name the host uses.

The registry (`registry.py`, distribution v3) listens on the host's loopback
(`127.0.0.1:PORT`), which a real node's network namespace (`realnode.py`) does not see. So:
- `netnsproxy` opens the same `127.0.0.1:PORT` inside the node's namespace and relays it to
  the registry: an image reference pushed from the host (`127.0.0.1:PORT/tardigrade-dev/...`)
  is the one a pod names and the kubelet pulls, with no rewriting;
- containerd's CRI reads the registry's host configuration from a `config_path` directory
  (containerd's docs/hosts.md): `<config_path>/127.0.0.1:PORT/hosts.toml` says plain HTTP
  (the registry has no TLS) and that this host may resolve and pull. Without it containerd
  2.4 guesses for a loopback host with a port (`core/remotes/docker/config/hosts.go`): it
  logs "host will try HTTPS first" and falls back to HTTP (tried here: the pull worked); the
  file makes the choice explicit, as a user of a registry without TLS writes it.

The kubelet pulls through the CRI as on GKE (`imagePullPolicy` decides), nothing is imported.
"""

from __future__ import annotations

from pathlib import Path

PROXY_NAME = "registry-proxy"


class NodeRegistryError(ValueError):
    pass


def split_host(registry: str) -> tuple[str, int]:
    """`127.0.0.1:PORT` -> ("127.0.0.1", PORT); anything else is refused: the proxy opens
    the same address inside the node's namespace, whose loopback is 127.0.0.1 too."""
    host, _, port = registry.rpartition(":")
    if host != "127.0.0.1" or not port.isdigit() or not 0 < int(port) < 65536:
        raise NodeRegistryError(
            f"registry {registry!r}: a real node reaches a registry on this host's loopback "
            f"only; give it as 127.0.0.1:PORT (Registry.host)")
    return host, int(port)


def hosts_toml(registry: str) -> str:
    """containerd's host configuration for the plain-HTTP registry at `registry`."""
    split_host(registry)
    return (f'server = "http://{registry}"\n\n'
            f'[host."http://{registry}"]\n'
            '  capabilities = ["pull", "resolve"]\n')


def write_hosts(config_path: Path, registry: str) -> Path:
    """Write `<config_path>/<registry>/hosts.toml` (containerd's directory for a host with a
    port is `host:port`, docs/hosts.md "Port Handling"); returns its path."""
    path = config_path / registry / "hosts.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(hosts_toml(registry))
    return path


def proxy_argv(python: str, netns_path: Path, registry: str) -> list[str]:
    """The `netnsproxy` command: the registry's own address inside the node's namespace."""
    _, port = split_host(registry)
    return [python, "-m", "tardigrade_local.netnsproxy", str(netns_path), str(port), registry]
