"""The one OCI image real nodes have: Debian's static busybox, built here with umoci.

No registry is reachable from our machines (`registry.k8s.io/pause` cannot be pulled), so a
real node's containerd gets its images imported (`ctr -n k8s.io images import`). The archive
holds two tags of the same single layer (`/bin/busybox` and a link per applet):
- `BUSYBOX_IMAGE`: `/bin/sh` by default, for test pods (`imagePullPolicy: Never`);
- `SANDBOX_IMAGE`: `sleep` forever, the pod sandbox ("pause") image pinned in containerd's
  CRI config. Unlike the real pause it reaps no zombies (nothing in our pods needs it).

The archive is cached, keyed by the busybox binary, umoci's version and this recipe, so it is
built once per machine (`python -m tardigrade_local.nodeimage` prints its path).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BUSYBOX = Path("/bin/busybox")
# ctr names each tag of an OCI archive `<base name>:<tag>` (`--base-name`).
BASE_NAME = "tardigrade.local/busybox"
BUSYBOX_TAG = "sh"
SANDBOX_TAG = "sandbox"
BUSYBOX_IMAGE = f"{BASE_NAME}:{BUSYBOX_TAG}"
SANDBOX_IMAGE = f"{BASE_NAME}:{SANDBOX_TAG}"
RECIPE = "1"  # bump when the steps below change


class ImageError(RuntimeError):
    pass


def _cache_dir() -> Path:
    base = os.environ.get("TARDIGRADE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tardigrade")
    return Path(base) / "nodeimages"


def _run(*argv: str) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, check=True)
    except FileNotFoundError as err:
        raise ImageError(f"{argv[0]} is needed to build the real nodes' image (scripts/setup "
                         f"installs Debian's umoci and busybox-static as root)") from err
    except subprocess.CalledProcessError as err:
        raise ImageError(f"{' '.join(argv)} failed: {err.stderr.strip()}") from err
    return done.stdout


def _key() -> str:
    if not BUSYBOX.is_file():
        raise ImageError(f"{BUSYBOX} is missing: scripts/setup installs Debian's busybox-static")
    digest = hashlib.sha256(BUSYBOX.read_bytes())
    digest.update(_run("umoci", "--version").encode())
    digest.update(RECIPE.encode())
    return digest.hexdigest()[:16]


def archive() -> Path:
    """The OCI archive (tar of an image layout) with both tags; built if missing."""
    target = _cache_dir() / f"busybox-{_key()}.tar"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        work = Path(tmp)
        rootfs, layout = work / "rootfs", work / "oci"
        (rootfs / "bin").mkdir(parents=True)
        (rootfs / "tmp").mkdir(mode=0o1777)
        shutil.copy2(BUSYBOX, rootfs / "bin" / "busybox")
        for applet in _run(str(BUSYBOX), "--list").split():
            if applet != "busybox":
                (rootfs / "bin" / applet).symlink_to("busybox")
        image = f"{layout}:{BUSYBOX_TAG}"
        _run("umoci", "init", "--layout", str(layout))
        _run("umoci", "new", "--image", image)
        _run("umoci", "insert", "--image", image, str(rootfs), "/")
        _run("umoci", "config", "--image", image, "--config.env", "PATH=/bin",
             "--config.cmd", "/bin/sh")
        _run("umoci", "config", "--image", image, "--tag", SANDBOX_TAG,
             "--config.entrypoint", "/bin/sleep", "--config.cmd", "2147483647")
        _run("umoci", "gc", "--layout", str(layout))
        partial = work / "image.tar"
        _run("tar", "-C", str(layout), "-cf", str(partial), ".")
        partial.replace(target)
    return target


def import_into(ctr: Path, address: str) -> None:
    """Import both tags into the containerd at `address`, in the CRI's namespace."""
    _run(str(ctr), "--address", address, "-n", "k8s.io", "images", "import",
         "--base-name", BASE_NAME, str(archive()))


if __name__ == "__main__":
    try:
        print(archive())
    except ImageError as err:
        sys.exit(f"nodeimage: {err}")
