"""The container image and ``bench/container_cluster.py``.

Everywhere: the Dockerfile's shape (two stages, no toolchain in the final one, the
daemon as default command on the folders the bench script mounts), ``make image``'s
command, and the bench script's refusals of bad options.

With root, podman and the image already built (``make image`` or ``python
bench/container_cluster.py``; tag ``$HAPD_TEST_IMAGE``, default the bench script's): two
containers of the image in network namespaces answer pings and compile a drop, and
nothing is left once the cluster is closed. Skipped with the reason elsewhere: no
image is built here (that takes minutes; the bench script does it).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import _bench
import pytest

import hapd

ROOT = Path(__file__).resolve().parents[2]
cc = _bench.load("container_cluster")


def _stages(text: str) -> list[list[str]]:
    """The Dockerfile's instructions (continuations joined, comments dropped), per stage."""
    lines, joined = [], ""
    for raw in text.splitlines():
        if raw.lstrip().startswith("#") and not joined:
            continue
        joined += raw.rstrip("\\").rstrip() + " " if raw.endswith("\\") else raw
        if not raw.endswith("\\"):
            if joined.strip():
                lines.append(joined.strip())
            joined = ""
    stages: list[list[str]] = []
    for line in lines:
        if line.upper().startswith("FROM "):
            stages.append([])
        if stages:
            stages[-1].append(line)
    return stages


def test_dockerfile_builds_the_wheel_apart_and_serves_by_default():
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE=pytorch/pytorch:\S+", text, re.M), "the default base is the official PyTorch image"
    build, final = _stages(text)
    assert build[0] == "FROM ${BASE} AS build" and final[0] == "FROM ${BASE}"
    build_text, final_text = "\n".join(build), "\n".join(final)
    assert "rustup-init" in build_text and "pip wheel" in build_text
    # the Rust extension builds in a layer that depends on rustcore/ (and pyproject) only: an
    # edit under hapd/ or launcher/ reuses it (the second wheel finds cargo's crates fresh)
    at = {word: next(i for i, line in enumerate(build) if line.startswith(word))
          for word in ("COPY rustcore", "COPY hapd", "COPY launcher")}
    wheels = [i for i, line in enumerate(build) if line.startswith("RUN") and "pip wheel" in line]
    assert len(wheels) == 2 and at["COPY rustcore"] < wheels[0] < at["COPY hapd"] < at["COPY launcher"] < wheels[1]
    # no Rust toolchain, compiler or source tree in the final stage: only the wheel crosses over
    for word in ("rustup", "cargo", "build-essential", "COPY . ", "COPY rustcore", "COPY hapd "):
        assert word not in final_text, word
    assert [line for line in final if "--from=" in line] == ["COPY --from=build /wheels /tmp/wheels"]
    assert "rm -rf /tmp/wheels" in final_text and "--no-cache-dir" in final_text
    # the daemon on the key, state and drop folder the bench script mounts
    cmd = re.search(r"^CMD (\[.*\])$", final_text, re.M).group(1)
    assert cmd.startswith('["hapd", "serve", ')
    for flag, path in (("--key", cc.KEY_IN_IMAGE), ("--state", cc.STATE_IN_IMAGE), ("--watch", cc.WATCH_IN_IMAGE)):
        assert f'"{flag}", "{path}"' in cmd, (flag, cmd)
    assert f'VOLUME ["{cc.STATE_IN_IMAGE}", "{cc.WATCH_IN_IMAGE}"]' in final_text


def test_dockerignore_keeps_the_constraints_and_drops_build_outputs():
    ignore = (ROOT / ".dockerignore").read_text().split()
    assert "!.ci/oldest.txt" in ignore and ignore.index(".ci") < ignore.index("!.ci/oldest.txt")
    for path in ("rustcore/target", "**/*.so", ".venv"):
        assert path in ignore


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_image_passes_base_tag_ca_and_flags():
    done = subprocess.run(["make", "-n", "-C", str(ROOT), "image", "BASE=localhost/base:x", "IMAGE=localhost/hapd:t",
                           "CA_BUNDLE=/some/ca.pem", "IMAGE_FLAGS=--no-cache"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    builders = [line for line in done.stdout.splitlines() if "buildah bud" in line or "docker build" in line]
    assert len(builders) == 2
    for line in builders:
        for part in ("--force-rm", "--no-cache", "--build-arg BASE=localhost/base:x", "--secret id=ca,src=/some/ca.pem",
                     "-t localhost/hapd:t"):
            assert part in line, (part, line)
    plain = subprocess.run(["make", "-n", "-C", str(ROOT), "image", "CA_BUNDLE="], capture_output=True, text=True,
                           timeout=60)
    assert "--build-arg" not in plain.stdout and "--secret" not in plain.stdout  # the Dockerfile's default base


def test_build_command_is_make_image():
    cmd = cc.build_command(image="img", base="b", cache=False, ca_bundle=Path("/ca"))
    assert cmd[:4] == ["make", "-C", str(ROOT), "image"]
    assert {"IMAGE=img", "BASE=b", "CA_BUNDLE=/ca", "IMAGE_FLAGS=--no-cache"} <= set(cmd)
    assert "IMAGE_FLAGS=" in cc.build_command(image="img", base="b", cache=True, ca_bundle=None)


@pytest.mark.parametrize("args, message", [
    (["--hosts", "4"], "--hosts 4: an emulated cluster here has 2 or 3"),
    (["--ranks", "0"], "--ranks 0 must be ≥ 1"),
    (["--iterations", "2", "--warmup", "2"], "--warmup 2 must be less than --iterations 2"),
    (["--batch", "3"], "--batch 3: fewer samples than the job's 6 ranks"),
    (["--rate-mbit", "0"], "--rate-mbit 0.0: a link rate"),
    (["--model", "nope"], "--model 'nope': choose one of"),
    (["--ca-bundle", "/no/such/ca.pem"], "--ca-bundle /no/such/ca.pem: no such file"),
    (["--cold", "--no-build"], "--cold builds, --no-build does not"),
])
def test_bad_options_are_refused_with_the_reason(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cc.parse_args(args)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_podman_flags_are_options():
    podman = cc.Podman(runtime="crun", cgroup_manager="systemd", ulimits=("nofile=4096:4096",))
    assert podman.cmd == ["podman", "--runtime", "crun", "--cgroup-manager", "systemd"]
    assert podman.run_flags() == ["--ulimit", "nofile=4096:4096"]


# ----------------------------------------------------------------------------- with podman

IMAGE = os.environ.get("HAPD_TEST_IMAGE", cc.DEFAULT_IMAGE)


def _need_podman_and_image() -> cc.Podman:
    why = cc.available(build=False)
    if why:
        pytest.skip(why)
    podman = cc.Podman()
    if not podman.image_exists(IMAGE):
        pytest.skip(f"no image {IMAGE} here (build it with `python bench/container_cluster.py` or "
                    f"`make image IMAGE={IMAGE}`; $HAPD_TEST_IMAGE names another)")
    return podman


@pytest.mark.slow
@pytest.mark.daemon
def test_containers_serve_compile_a_drop_and_leave_nothing(tmp_path):
    podman = _need_podman_and_image()
    cls = cc.make_container_cluster_class()
    cluster = cls(tmp_path, 2, 1, image=IMAGE, podman=podman)
    try:
        cluster.create()
        cluster.shape(500.0)
        cluster.start()
        for i, pong in enumerate(cluster.pongs):
            assert pong["version"] == hapd.__version__ and pong["host"] == f"host{i}"
        # the daemons reach each other across the shaped links: one's ping from the other's namespace
        done = subprocess.run(["ip", "netns", "exec", cluster.namespaces[1], sys.executable, "-m", "hapd.cli", "ping",
                               cluster.addresses[0], "--key", str(cluster.key_file), "--timeout", "30"],
                              capture_output=True, text=True, timeout=120, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert done.returncode == 0 and "on host0" in done.stdout, done.stderr
        pt2 = cc.export_graph("mlp", 8, tmp_path / "mlp.pt2")
        _, plan = cc.drop_and_wait(pt2, cluster.watches[1], timeout=300)
        assert plan == cluster.watches[1] / "out" / "mlp.hplan" and plan.stat().st_size > 0
    finally:
        cluster.close()
    assert cc.leftovers(podman, cluster) == []


@pytest.mark.daemon
def test_a_missing_image_is_a_clear_error_and_leaves_nothing(tmp_path):
    podman = _need_podman_and_image()
    cls = cc.make_container_cluster_class()
    cluster = cls(tmp_path, 2, 1, image="localhost/hapd-no-such-image:none", podman=podman)
    try:
        cluster.create()
        with pytest.raises(RuntimeError, match="hapd-no-such-image"):
            cluster.start()
    finally:
        cluster.close()
    assert cc.leftovers(podman, cluster) == []
