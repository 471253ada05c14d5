#!/usr/bin/env python3
"""``docker run … hapd`` for real: hapd's image built here, and an emulated cluster of
containers running it.

    python bench/container_cluster.py                    # 3 containers × 2 ranks, tiny bert
    python bench/container_cluster.py --cold             # also time a build without the layer cache
    python bench/container_cluster.py --hosts 2 --remove-images

Needs root, podman, buildah, ``ip`` and ``tc`` (and ``debootstrap`` the first time);
without them it prints why and exits 0. No Docker daemon and no registry are needed:

1. **base**: no base image can be pulled here, so a local one is made once with
   ``debootstrap --variant=minbase SUITE`` → tar → ``podman import`` and reused while an
   image of that name exists (``--base``; ``--base-image`` uses any existing image
   instead, e.g. the official PyTorch image where it can be pulled);
2. **image**: the repository's ``Dockerfile`` built by ``make image BASE=…`` (``buildah
   bud --isolation chroot --layers``), timed with the
   layer cache and, with ``--cold``, without it first; its size and what takes the space
   (the image's layers and the largest entries of its site-packages);
3. **hosts**: ``bench/launcher.py``'s :class:`NamespaceCluster` (one network namespace
   per host on a bridge, host ``i`` at ``10.77.N.(i+2)`` on ``hapd0``), each namespace's
   link shaped by ``tc … tbf rate R`` (``--rate-mbit``), and in each namespace one
   container of the image running its default command (``hapd serve`` on port 5557) with
   a mounted key file, state folder and drop folder; timed from ``podman run`` to the
   daemon answering a ping;
4. **drop**: ``hapd export`` of the model to a ``.pt2`` on this machine, moved into the
   first container's mounted drop folder, and the wait for its plan;
5. **job**: ``./run_all worker.py K --hosts FILE -- --model MODEL …`` from this machine
   across the containers, to completion, with the launcher's timing table;
6. **teardown** (also after Ctrl-C or a failure): containers, namespaces, the bridge, and
   with ``--remove-images`` the image and the base this run made; then a check that
   nothing of the run is left running or mounted.

Prints the numbers and writes them to ``bench/out/container_cluster.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hapd.errors import HapdError  # noqa: E402
from hapd.wire.client import Client  # noqa: E402

OUT = ROOT / "bench" / "out" / "container_cluster.json"
DEFAULT_IMAGE = "localhost/hapd:bench"
DEFAULT_BASE = "localhost/hapd-base:bookworm"
DEFAULT_SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
RUNTIME = "runc"
CGROUP_MANAGER = "cgroupfs"
ULIMITS = ("nofile=1024:1024", "nproc=1024:1024")
"""The ulimits a container gets (podman's defaults are refused on some kernels)."""
KEY_IN_IMAGE = "/etc/hapd/key"
STATE_IN_IMAGE = "/var/lib/hapd"
WATCH_IN_IMAGE = "/var/spool/hapd"
"""Where the Dockerfile's default command keeps its key, state and drop folder."""


def log(msg: str) -> None:
    print(f"[container {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _load_bench_launcher():
    name = "hapd_bench_launcher"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / "launcher.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def available(*, build: bool = True) -> str | None:
    """None when containers (and with ``build`` images) can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc, rootful podman)"
    tools = ("podman", "ip", "tc") + (("buildah",) if build else ())
    for tool in tools:
        if shutil.which(tool) is None:
            return f"needs {tool} (Debian: apt-get install podman buildah runc debootstrap)"
    return None


def _run(cmd: Sequence[str], *, timeout: float = 120, check: bool = True, **kw) -> subprocess.CompletedProcess:
    done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, **kw)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {done.returncode}: {(done.stderr or done.stdout).strip()[-3000:]}")
    return done


# ----------------------------------------------------------------------------- podman


@dataclass(frozen=True, kw_only=True)
class Podman:
    """How podman is called here."""

    runtime: str = RUNTIME
    """OCI runtime (``--runtime``): runc; crun is refused on some kernels."""
    cgroup_manager: str = CGROUP_MANAGER
    """``--cgroup-manager``: cgroupfs works without systemd."""
    ulimits: tuple[str, ...] = ULIMITS
    """``--ulimit`` of every container."""

    @property
    def cmd(self) -> list[str]:
        return ["podman", "--runtime", self.runtime, "--cgroup-manager", self.cgroup_manager]

    def run_flags(self) -> list[str]:
        return [flag for u in self.ulimits for flag in ("--ulimit", u)]

    def image_exists(self, image: str) -> bool:
        return _run([*self.cmd, "image", "exists", image], check=False).returncode == 0

    def image_id(self, image: str) -> str | None:
        done = _run([*self.cmd, "image", "inspect", "--format", "{{.Id}}", image], check=False)
        return done.stdout.strip() or None if done.returncode == 0 else None

    def image_ids(self) -> set[str]:
        return set(_run([*self.cmd, "images", "-a", "-q", "--no-trunc"]).stdout.split())

    def containers(self, prefix: str) -> list[str]:
        done = _run([*self.cmd, "ps", "-a", "--format", "{{.Names}}"])
        return [n for n in done.stdout.split() if n.startswith(prefix)]


# ----------------------------------------------------------------------------- base and image


def make_base(podman: Podman, name: str, *, suite: str, mirror: str, workdir: Path) -> float | None:
    """The local base image ``name``: reused when it exists (returns None), else made with
    ``debootstrap --variant=minbase`` and ``podman import`` (returns the seconds it took;
    the root file system and its tar are removed either way)."""
    if podman.image_exists(name):
        return None
    if shutil.which("debootstrap") is None:
        raise RuntimeError(f"no image {name} and no debootstrap to make it (apt-get install debootstrap)")
    t0 = time.monotonic()
    scratch = Path(tempfile.mkdtemp(prefix="hapd-base-", dir=workdir))
    try:
        rootfs, tar = scratch / "rootfs", scratch / "rootfs.tar"
        log(f"base {name}: debootstrap --variant=minbase {suite} ({mirror})")
        _run(["debootstrap", "--variant=minbase", suite, str(rootfs), mirror], timeout=1800)
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for entry in (rootfs / junk).glob("*"):
                if entry.is_file():
                    entry.unlink()
        _run(["tar", "--numeric-owner", "-C", str(rootfs), "-cf", str(tar), "."], timeout=600)
        _run([*podman.cmd, "import", "--change", 'CMD ["/bin/bash"]', str(tar), name], timeout=600)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return time.monotonic() - t0


def build_command(*, image: str, base: str, cache: bool, ca_bundle: Path | None) -> list[str]:
    """``make image`` with this image's tag, base and CA bundle (buildah where it is)."""
    return ["make", "-C", str(ROOT), "image", f"IMAGE={image}", f"BASE={base}", f"CA_BUNDLE={ca_bundle or ''}",
            f"IMAGE_FLAGS={'' if cache else '--no-cache'}"]


def build_image(*, image: str, base: str, cache: bool, ca_bundle: Path | None, log_path: Path) -> float:
    """Build; the seconds it took. The build's output goes to ``log_path``."""
    cmd = build_command(image=image, base=base, cache=cache, ca_bundle=ca_bundle)
    log(f"build ({'layer cache' if cache else 'no cache'}): {' '.join(cmd)}")
    t0 = time.monotonic()
    with open(log_path, "a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=7200)
    seconds = time.monotonic() - t0
    if done.returncode != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"image build exited with {done.returncode} (log {log_path}):\n{tail}")
    return seconds


SPACE_SCRIPT = r'''
site="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "== /"; du -x -s -m /usr /opt /var /root /etc 2>/dev/null | sort -rn
echo "== $site"; du -s -m "$site"/* 2>/dev/null | sort -rn | head -n 15
'''


def image_space(podman: Podman, image: str) -> dict[str, Any]:
    """The image's size, its layers' sizes, and the largest folders inside it."""
    size = int(_run([*podman.cmd, "image", "inspect", "--format", "{{.Size}}", image]).stdout.strip())
    history = json.loads(_run([*podman.cmd, "history", "--no-trunc", "--format", "json", image]).stdout or "[]")
    layers = [{"mb": round(h.get("size", 0) / 2**20, 1), "step": " ".join(str(h.get("CreatedBy", h.get("createdBy", ""))).split())[:160]}
              for h in history if h.get("size", 0) > 1 << 20]
    du = _run([*podman.cmd, "run", "--rm", "--network", "none", *podman.run_flags(), image, "sh", "-c", SPACE_SCRIPT],
              timeout=300).stdout
    folders: dict[str, list[dict[str, Any]]] = {}
    section = ""
    for line in du.splitlines():
        if line.startswith("== "):
            section = line[3:]
            folders[section] = []
        elif line.strip() and section:
            mb, path = line.split(None, 1)
            folders[section].append({"mb": int(mb), "path": path})
    return {"size_bytes": size, "layers_over_1mb": layers, "du_mb": folders}


# ----------------------------------------------------------------------------- the cluster


def make_container_cluster_class():
    bench = _load_bench_launcher()

    class ContainerCluster(bench.NamespaceCluster):
        """:class:`NamespaceCluster`'s namespaces, bridge and link shaping, with a container
        of ``image`` in each namespace in place of a daemon process. Host ``i``'s
        container ``hapd-cTAG-i`` runs the image's default command with ``KEY`` mounted
        read-only at /etc/hapd/key, ``WORK/daemonI`` at /var/lib/hapd and
        ``WORK/watchI`` at /var/spool/hapd."""

        def __init__(self, workdir: Path, n: int, slots: int, *, image: str, podman: Podman,
                     tag: int | None = None) -> None:
            super().__init__(workdir, n, slots, tag=tag)
            self.image, self.podman = image, podman
            self.names = [f"hapd-c{self.tag}-{i}" for i in range(n)]
            self.watches = [self.workdir / f"watch{i}" for i in range(n)]
            self.started: list[str] = []
            self.run_to_ping_s: list[float | None] = [None] * n
            self.pongs: list[dict[str, Any] | None] = [None] * n

        def start_daemon(self, i: int, timeout: float = 120.0) -> None:
            home, watch = self.homes[i], self.watches[i]
            home.mkdir(parents=True, exist_ok=True)
            watch.mkdir(parents=True, exist_ok=True)
            cmd = [*self.podman.cmd, "run", "-d", "--name", self.names[i], "--hostname", f"host{i}",
                   *self.podman.run_flags(), "--network", f"ns:/run/netns/{self.namespaces[i]}",
                   "-v", f"{self.key_file}:{KEY_IN_IMAGE}:ro", "-v", f"{home}:{STATE_IN_IMAGE}",
                   "-v", f"{watch}:{WATCH_IN_IMAGE}", self.image]
            self.started.append(self.names[i])
            t0 = time.monotonic()
            _run(cmd, timeout=120)
            self.addresses[i] = f"tcp://{self.ips[i]}:{self.PORT}"
            self.pongs[i] = self._wait_ping(i, t0 + timeout)
            self.run_to_ping_s[i] = time.monotonic() - t0

        def _wait_ping(self, i: int, deadline: float) -> dict[str, Any]:
            while True:
                try:
                    with Client(self.addresses[i], self.key_file, timeout_s=0.5) as client:
                        return client.ping()
                except HapdError:
                    pass
                state = _run([*self.podman.cmd, "inspect", "--format", "{{.State.Status}}", self.names[i]],
                             check=False).stdout.strip()
                if state != "running":
                    raise RuntimeError(f"container {self.names[i]} is {state or 'gone'}:\n{self.log(i)[-3000:]}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"container {self.names[i]}: no ping answer from {self.addresses[i]}:\n"
                                       f"{self.log(i)[-3000:]}")

        def log(self, i: int) -> str:
            done = _run([*self.podman.cmd, "logs", self.names[i]], check=False)
            return (done.stdout + done.stderr) or super().log(i)

        def stop_daemon(self, i: int) -> None:
            name = self.names[i]
            if name not in self.started:
                return
            _run([*self.podman.cmd, "stop", "-t", "20", name], check=False, timeout=60)
            (self.homes[i] / "container.log").write_text(self.log(i))
            _run([*self.podman.cmd, "rm", "-f", "-v", name], check=False, timeout=60)
            self.started.remove(name)

    return ContainerCluster


def leftovers(podman: Podman, cluster) -> list[str]:
    """What the run left: its containers, namespaces, links and mounts (empty when clean)."""
    left = [f"container {name}" for name in podman.containers(f"hapd-c{cluster.tag}-")]
    netns = _run(["ip", "netns", "list"], check=False).stdout.split()
    left += [f"network namespace {ns}" for ns in cluster.namespaces if ns in netns]
    links = _run(["ip", "-o", "link", "show"], check=False).stdout
    left += [f"link {name}" for name in [cluster.bridge, *(f"hl{cluster.tag}r{i}" for i in range(cluster.n))]
             if f" {name}:" in links or f" {name}@" in links]
    mounts = Path("/proc/self/mountinfo").read_text()
    left += [f"mount of {what}" for what in [*cluster.namespaces, str(cluster.workdir)] if what in mounts]
    return left


# ----------------------------------------------------------------------------- drop and job


def export_graph(model: str, batch: int, out: Path) -> Path:
    """``hapd export MODEL`` on this machine (tiny size): the .pt2 path."""
    _run([sys.executable, "-m", "hapd.cli", "export", model, "--batch", str(batch), "--out", str(out), "--no-hapg"],
         timeout=600, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return out


def drop_and_wait(pt2: Path, watch: Path, timeout: float) -> tuple[float, Path]:
    """Move a copy of ``pt2`` into the drop folder atomically (through WATCH/.incoming)
    and wait for WATCH/out/NAME.hplan; (seconds, plan path). A WATCH/failed/NAME.error
    is raised with its text."""
    incoming = watch / ".incoming"
    incoming.mkdir(parents=True, exist_ok=True)
    stem = pt2.stem
    plan, error = watch / "out" / f"{stem}.hplan", watch / "failed" / f"{stem}.error"
    shutil.copyfile(pt2, incoming / pt2.name)
    t0 = time.monotonic()
    os.rename(incoming / pt2.name, watch / pt2.name)
    while time.monotonic() - t0 < timeout:
        if plan.is_file():
            return time.monotonic() - t0, plan
        if error.is_file():
            raise RuntimeError(f"the daemon refused the drop {pt2.name}: {error.read_text(errors='replace')[-2000:]}")
        time.sleep(0.1)
    raise RuntimeError(f"no plan for the drop {pt2.name} in {watch / 'out'} after {timeout:.0f} s")


def job_command(*, hostfile: Path, ranks: int, key: Path, env: dict[str, str], report: Path, model: str, batch: int,
                iterations: int, warmup: int) -> list[str]:
    cmd = [str(ROOT / "run_all"), "worker.py", str(ranks), "--hosts", str(hostfile), "--key", str(key),
           "--report", str(report)]
    for name, value in env.items():
        cmd += ["--env", f"{name}={value}"]
    return cmd + ["--", "--model", model, "--batch", str(batch), "--iterations", str(iterations),
                  "--warmup", str(warmup)]


def run_job(cmd: list[str], timeout: float) -> tuple[float, str]:
    """The job to completion: (seconds, its output); a failed job raises with its output."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HAPD_PYTHON": os.environ.get("HAPD_PYTHON", sys.executable)}
    log(f"job: {' '.join(cmd)}")
    t0 = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env,
                          stdin=subprocess.DEVNULL)
    seconds = time.monotonic() - t0
    if done.returncode != 0:
        raise RuntimeError(f"the job exited with {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return seconds, done.stdout + done.stderr


# ----------------------------------------------------------------------------- the run


@dataclass
class Made:
    """What this run made, so that teardown removes just that."""

    base: str | None = None
    image: str | None = None
    image_ids_before: set[str] = field(default_factory=set)
    build_containers_before: set[str] = field(default_factory=set)


def build_containers() -> set[str]:
    """buildah's working containers (a build interrupted mid-step leaves its own)."""
    if shutil.which("buildah") is None:
        return set()
    return set(_run(["buildah", "containers", "-q", "--notruncate"], check=False).stdout.split())


def remove_build_containers(made: Made) -> list[str]:
    """The working containers of this run's builds that are still there; their ids."""
    left = sorted(build_containers() - made.build_containers_before)
    for cid in left:
        _run(["buildah", "rm", cid], check=False, timeout=120)
    return [cid[:12] for cid in left]


def remove_images(podman: Podman, made: Made) -> list[str]:
    """The image and base this run made, and the build's intermediate images (only those
    that did not exist before the run); what was removed."""
    removed = []
    for name in (made.image, made.base):
        if name and podman.image_exists(name):
            _run([*podman.cmd, "rmi", "-f", name], check=False, timeout=300)
            removed.append(name)
    for image_id in sorted(podman.image_ids() - made.image_ids_before):
        if _run([*podman.cmd, "rmi", image_id], check=False, timeout=300).returncode == 0:
            removed.append(image_id[:12])
    return removed


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", type=int, default=3, help="containers, one per emulated host: 2 or 3 (default 3)")
    p.add_argument("--ranks", type=int, default=2, help="ranks per host (default 2)")
    p.add_argument("--rate-mbit", type=float, default=1000.0, help="each host's link rate, tc tbf (default 1000)")
    p.add_argument("--model", default="bert", help="benchmark model to drop and train (default bert, tiny size)")
    p.add_argument("--batch", type=int, default=24, help="global batch of the drop and the job (default 24)")
    p.add_argument("--iterations", type=int, default=6, help="timed iterations of the job (default 6)")
    p.add_argument("--warmup", type=int, default=1, help="leading iterations left out of the mean (default 1)")
    p.add_argument("--image", default=DEFAULT_IMAGE, help=f"tag of the image built (default {DEFAULT_IMAGE})")
    p.add_argument("--base", default=DEFAULT_BASE,
                   help=f"local Debian base image, made with debootstrap unless it exists (default {DEFAULT_BASE})")
    p.add_argument("--base-image", default=None,
                   help="build on this existing image instead (e.g. the official PyTorch image) and make no base")
    p.add_argument("--suite", default=DEFAULT_SUITE, help=f"debootstrap suite of the base (default {DEFAULT_SUITE})")
    p.add_argument("--mirror", default=DEFAULT_MIRROR, help=f"debootstrap mirror (default {DEFAULT_MIRROR})")
    p.add_argument("--ca-bundle", type=Path, default=os.environ.get("SSL_CERT_FILE") or None,
                   help="CA bundle the build's downloads trust, given to the build as the secret 'ca' (for a proxy "
                        "that re-signs TLS; default $SSL_CERT_FILE when set)")
    p.add_argument("--cold", action="store_true", help="first build without the layer cache, timed (downloads all)")
    p.add_argument("--no-build", action="store_true", help="use --image as it is (it must exist)")
    p.add_argument("--remove-images", action="store_true",
                   help="at the end, remove the image, the base this run made and the build's new intermediate images")
    p.add_argument("--runtime", default=RUNTIME, help=f"podman's OCI runtime (default {RUNTIME})")
    p.add_argument("--cgroup-manager", default=CGROUP_MANAGER, help=f"podman's cgroup manager (default {CGROUP_MANAGER})")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for the drop's plan and for the job (default 900)")
    p.add_argument("--json", type=Path, default=OUT, help=f"where the numbers go (default {OUT.relative_to(ROOT)})")
    ns = p.parse_args(argv)
    if ns.hosts not in (2, 3):
        p.error(f"--hosts {ns.hosts}: an emulated cluster here has 2 or 3 containers (2 cores)")
    for name, least in (("ranks", 1), ("batch", 1), ("iterations", 1), ("warmup", 0)):
        if getattr(ns, name) < least:
            p.error(f"--{name} {getattr(ns, name)} must be ≥ {least}")
    if ns.warmup >= ns.iterations:
        p.error(f"--warmup {ns.warmup} must be less than --iterations {ns.iterations}")
    if ns.batch < ns.hosts * ns.ranks:
        p.error(f"--batch {ns.batch}: fewer samples than the job's {ns.hosts * ns.ranks} ranks")
    if not (ns.rate_mbit > 0 and ns.rate_mbit < 1e6):
        p.error(f"--rate-mbit {ns.rate_mbit}: a link rate in Mbit/s, > 0 and < 1e6")
    if not ns.timeout > 0:
        p.error(f"--timeout {ns.timeout} must be > 0")
    if ns.ca_bundle is not None and not ns.ca_bundle.is_file():
        p.error(f"--ca-bundle {ns.ca_bundle}: no such file")
    if ns.no_build and ns.cold:
        p.error("--cold builds, --no-build does not: choose one")
    from hapd.models import MODELS

    if ns.model not in MODELS:
        p.error(f"--model {ns.model!r}: choose one of {', '.join(MODELS)}")
    return ns


def _on_term(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    ns = parse_args(argv)
    why = available(build=not ns.no_build)
    if why:
        print(f"container_cluster: skipped: {why}")
        return 0
    signal.signal(signal.SIGTERM, _on_term)  # a bench script: SIGTERM tears down like Ctrl-C
    podman = Podman(runtime=ns.runtime, cgroup_manager=ns.cgroup_manager)
    made = Made(image_ids_before=podman.image_ids(), build_containers_before=build_containers())
    results: dict[str, Any] = {"hosts": ns.hosts, "ranks_per_host": ns.ranks, "rate_mbit": ns.rate_mbit,
                               "model": ns.model, "batch": ns.batch, "image": ns.image}
    work = Path(tempfile.mkdtemp(prefix="hapd-container-"))
    cluster = None
    try:
        # -- base and image
        if ns.no_build:
            if not podman.image_exists(ns.image):
                raise RuntimeError(f"--no-build: no image {ns.image} (build it: make image, or run without --no-build)")
            base = None
        elif ns.base_image:
            base = ns.base_image
        else:
            base = ns.base
            seconds = make_base(podman, base, suite=ns.suite, mirror=ns.mirror, workdir=work)
            if seconds is not None:
                made.base = base
            results["base"] = {"image": base, "made_s": seconds, "reused": seconds is None}
            log(f"base {base}: " + ("reused" if seconds is None else f"made in {seconds:.1f} s"))
        if not ns.no_build:
            results["base_image"] = base
            build_log = ns.json.parent / "container_build.log"
            build_log.parent.mkdir(parents=True, exist_ok=True)
            build_log.write_text("")
            replaced = podman.image_id(ns.image)
            if not replaced:
                made.image = ns.image
            builds: dict[str, float] = {}
            kw = dict(image=ns.image, base=base, ca_bundle=ns.ca_bundle, log_path=build_log)
            if ns.cold:
                builds["cold_s"] = build_image(cache=False, **kw)
                log(f"cold build: {builds['cold_s']:.1f} s")
            builds["layer_cache_s"] = build_image(cache=True, **kw)
            log(f"build with the layer cache: {builds['layer_cache_s']:.1f} s")
            if replaced and replaced != podman.image_id(ns.image) and replaced in podman.image_ids():
                # the image this build replaced under the same tag, now untagged
                _run([*podman.cmd, "rmi", replaced], check=False, timeout=300)
            results["build"] = builds
        space = image_space(podman, ns.image)
        results["image_space"] = space
        log(f"image {ns.image}: {space['size_bytes'] / 1e9:.2f} GB")

        # -- the cluster of containers
        cls = make_container_cluster_class()
        cluster = cls(work, ns.hosts, ns.ranks, image=ns.image, podman=podman)
        cluster.create()
        cluster.shape(ns.rate_mbit)
        cluster.start()
        results["run_to_ping_s"] = cluster.run_to_ping_s
        for i, pong in enumerate(cluster.pongs):
            log(f"{cluster.names[i]} at {cluster.addresses[i]}: hapd {pong['version']} on {pong['host']}, "
                f"{pong['slots']} slots; podman run → ping {cluster.run_to_ping_s[i]:.2f} s")
            if pong["slots"] < ns.ranks:
                raise RuntimeError(f"{cluster.names[i]} offers {pong['slots']} slots, fewer than --ranks {ns.ranks}")

        # -- a drop
        pt2 = export_graph(ns.model, ns.batch, work / f"{ns.model}.pt2")
        drop_s, plan = drop_and_wait(pt2, cluster.watches[0], ns.timeout)
        results["drop"] = {"graph": pt2.name, "plan": plan.name, "plan_bytes": plan.stat().st_size, "drop_to_plan_s": drop_s}
        log(f"drop {pt2.name} → {plan.name} in {drop_s:.1f} s")

        # -- a job across the containers
        hostfile = work / "hosts.txt"
        hostfile.write_text(cluster.host_lines())
        report = work / "job.json"
        cmd = job_command(hostfile=hostfile, ranks=ns.ranks, key=cluster.key_file, env=dict(cluster.env), report=report,
                          model=ns.model, batch=ns.batch, iterations=ns.iterations, warmup=ns.warmup)
        job_s, output = run_job(cmd, ns.timeout)
        print("\n".join(line for line in output.splitlines() if not line.startswith("[rank")))
        job_report = json.loads(report.read_text())
        results["job"] = {"wall_s": job_s, "world_size": job_report.get("world_size"),
                          "hosts": sorted({r.get("host") for r in job_report.get("ranks", []) if r.get("host")}),
                          "report": job_report}
        log(f"job: {job_report.get('world_size')} ranks on {ns.hosts} containers, finished in {job_s:.1f} s")
    finally:
        results["removed_build_containers"] = remove_build_containers(made)
        if cluster is not None:
            cluster.close()
            results["leftovers"] = leftovers(podman, cluster)
        shutil.rmtree(work, ignore_errors=True)
        if ns.remove_images:
            results["removed_images"] = remove_images(podman, made)
        ns.json.parent.mkdir(parents=True, exist_ok=True)
        ns.json.write_text(json.dumps(results, indent=1, default=str))
    report_numbers(results)
    print(f"wrote {ns.json}")
    return 1 if results.get("leftovers") else 0


def report_numbers(results: dict[str, Any]) -> None:
    space = results.get("image_space", {})
    print(f"image {results['image']}: {space.get('size_bytes', 0) / 1e9:.2f} GB")
    for section, rows in space.get("du_mb", {}).items():
        print(f"  largest in {section}: " + ", ".join(f"{r['path'].rsplit('/', 1)[-1]} {r['mb']} MB" for r in rows[:8]))
    for name, seconds in results.get("build", {}).items():
        print(f"build {name[:-2].replace('_', ' ')}: {seconds:.1f} s")
    pings = [s for s in results.get("run_to_ping_s", []) if s is not None]
    if pings:
        print(f"podman run → daemon answers ping: " + ", ".join(f"{s:.2f} s" for s in pings))
    if "drop" in results:
        print(f"drop → plan: {results['drop']['drop_to_plan_s']:.1f} s")
    if "job" in results:
        print(f"job: {results['job']['world_size']} ranks, {results['job']['wall_s']:.1f} s")
    left = results.get("leftovers")
    print("left running or mounted: " + (", ".join(left) if left else "nothing"))


if __name__ == "__main__":
    sys.exit(main())
