"""A local stand-in for ``python:3.11-slim``, made from Debian packages, for machines with no registry.

No image registry is reachable from the machines this project is built on, so the official base image
cannot be pulled. ``debootstrap`` makes a minimal Debian bookworm (its Python is 3.11) from the Debian
mirror apt already uses, and ``docker import`` turns it into an image. The tag carries a hash of the
recipe (every argument below and the extra CA certificates it bakes in): a changed recipe builds a new
image, an unchanged one is reused from the daemon's store, so only the first run on a machine pays
for it (about 40 s).

The host's extra CA certificates (``/usr/local/share/ca-certificates``) go into the image, with
``update-ca-certificates`` run there: where egress to the package index passes through an
intercepting proxy, pip inside the build trusts what the host trusts. Nothing else of the host's pip
settings is carried: the build installs from the package index itself.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

SUITE = "bookworm"
# python3-venv: the Dockerfile installs llmgw into a venv (Debian's Python refuses a system-wide
# `pip install .`, PEP 668); ca-certificates: pip's HTTPS to the index.
PACKAGES = ("python3", "python3-venv", "python3-pip", "ca-certificates")
EXTRA_CA_DIR = Path("/usr/local/share/ca-certificates")
REPOSITORY = "llmgw-compose-base"
# What `docker import` sets on the image. PIP_CERT: the venv's pip (ensurepip's wheel) would otherwise
# use its own bundled CA list, which lacks the certificates added above.
CHANGES = (
    "ENV LANG=C.UTF-8",
    "ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt",
    "ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt",
    'CMD ["python3"]',
)
# Bumped by hand when the steps below change in a way the inputs do not show.
RECIPE_VERSION = "1"


def debian_mirror() -> str:
    """The Debian mirror apt on this host uses (deb822 or one-line sources), else deb.debian.org."""
    candidates = [Path("/etc/apt/sources.list.d/debian.sources"), Path("/etc/apt/sources.list")]
    for path in candidates:
        try:
            text = path.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            words = line.split()
            if line.startswith("URIs:") and len(words) > 1 and "security" not in words[1]:
                return words[1]
            if words[:1] == ["deb"] and SUITE in words:
                urls = [w for w in words if w.startswith("http")]
                if urls and "security" not in urls[0]:
                    return urls[0]
    return "http://deb.debian.org/debian"


def extra_certificates() -> list[Path]:
    if not EXTRA_CA_DIR.is_dir():
        return []
    return sorted(p for p in EXTRA_CA_DIR.rglob("*.crt") if p.is_file())


def recipe_tag(mirror: str, certs: list[Path]) -> str:
    """``<repository>:<suite>-<hash of the recipe>``: the cache key of the image."""
    h = hashlib.sha256()
    for part in (RECIPE_VERSION, SUITE, mirror, *PACKAGES, *CHANGES):
        h.update(part.encode() + b"\0")
    for cert in certs:
        h.update(cert.name.encode() + b"\0" + cert.read_bytes() + b"\0")
    return f"{REPOSITORY}:{SUITE}-{h.hexdigest()[:12]}"


def image_exists(docker: str, tag: str) -> bool:
    return (
        subprocess.run(
            [docker, "image", "inspect", tag], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        ).returncode
        == 0
    )


def ensure_base_image(docker: str = "docker", log: bool = True) -> str:
    """The tag of the local base image, built first if this recipe has no image yet."""
    mirror = debian_mirror()
    certs = extra_certificates()
    tag = recipe_tag(mirror, certs)
    if image_exists(docker, tag):
        if log:
            print(f"compose-test: base image {tag} (cached)", flush=True)
        return tag
    t0 = time.monotonic()
    if log:
        print(f"compose-test: building base image {tag} with debootstrap from {mirror}", flush=True)
    with tempfile.TemporaryDirectory(prefix="llmgw-base-") as tmp:
        root = Path(tmp) / "rootfs"
        subprocess.run(
            [
                "nice",
                "debootstrap",
                "--variant=minbase",
                f"--include={','.join(PACKAGES)}",
                SUITE,
                str(root),
                mirror,
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        target = root / EXTRA_CA_DIR.relative_to("/")
        target.mkdir(parents=True, exist_ok=True)
        for cert in certs:
            shutil.copyfile(cert, target / cert.name)
        subprocess.run(["chroot", str(root), "update-ca-certificates"], check=True, stdout=subprocess.DEVNULL)
        # What an image needs none of: the package lists and caches debootstrap leaves (tens of MB).
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for p in (root / junk).glob("*"):
                if p.is_file():
                    p.unlink()
        changes = [arg for c in CHANGES for arg in ("--change", c)]
        tar = subprocess.Popen(["tar", "-C", str(root), "--numeric-owner", "-c", "."], stdout=subprocess.PIPE)
        try:
            subprocess.run([docker, "import", *changes, "-", tag], stdin=tar.stdout, check=True)
        finally:
            if tar.stdout is not None:
                tar.stdout.close()
            if tar.wait() != 0:
                raise RuntimeError(f"tar of the base image's root failed (exit {tar.returncode})")
    if log:
        print(f"compose-test: base image built in {time.monotonic() - t0:.0f} s", flush=True)
    return tag


if __name__ == "__main__":
    print(ensure_base_image(docker=os.environ.get("DOCKER", "docker")))
