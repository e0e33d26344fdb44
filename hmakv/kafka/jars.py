"""Apache Kafka's broker jars, fetched once with Maven into a cache keyed by Kafka's version.

The pom next to this module is the single source of truth for what the broker runs on. The cache
remembers which pom filled it, so editing the pom (a new log4j, say) refetches instead of quietly
running the old classpath.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import xml.etree.ElementTree as ElementTree
from pathlib import Path

POM_PATH = Path(__file__).with_name("pom.xml")
_POM_NAMESPACE = {"m": "http://maven.apache.org/POM/4.0.0"}
_POM_DIGEST_FILE = ".pom-sha256"


class JarFetchError(RuntimeError):
    """Maven is missing or could not fetch the jars; the message names the command to run."""


def cache_dir() -> Path:
    """Where hmakv keeps downloads and run state; ``HMAKV_CACHE_DIR`` moves it (CI caches it).

    Absolute even when ``HMAKV_CACHE_DIR`` is relative: the Apache broker runs in its data dir,
    and a relative classpath would point into it.
    """
    configured = os.environ.get("HMAKV_CACHE_DIR")
    return Path(configured).absolute() if configured else Path.home() / ".cache" / "hmakv"


def kafka_version() -> str:
    """The Kafka release the pom pins, read from the pom so the two can never disagree."""
    version = ElementTree.parse(POM_PATH).find("m:properties/m:kafka.version", _POM_NAMESPACE)
    if version is None or not version.text:
        raise JarFetchError(f"{POM_PATH} has no <kafka.version> property")
    return version.text.strip()


def jars_dir() -> Path:
    """The broker's classpath directory for the pinned Kafka version."""
    return cache_dir() / "kafka" / kafka_version() / "libs"


def maven_command(output_dir: Path) -> list[str]:
    """The Maven invocation that copies the broker's runtime jars into ``output_dir``."""
    return [
        "mvn",
        "-q",
        "-B",
        "-f",
        str(POM_PATH),
        "dependency:copy-dependencies",
        "-DincludeScope=runtime",
        f"-DoutputDirectory={output_dir}",
    ]


def fetch_jars() -> Path:
    """Return the jars directory, running Maven first unless this pom already filled it."""
    libs = jars_dir()
    if _filled_by_current_pom(libs):
        return libs
    if shutil.which("mvn") is None:
        raise JarFetchError(
            "Apache Kafka's jars are not cached and Maven (mvn) is not on PATH; install Maven "
            f"or run this where it is: {' '.join(maven_command(libs))}"
        )
    _download_into(libs)
    return libs


def _pom_digest() -> str:
    return hashlib.sha256(POM_PATH.read_bytes()).hexdigest()


def _filled_by_current_pom(libs: Path) -> bool:
    digest_file = libs / _POM_DIGEST_FILE
    return digest_file.is_file() and digest_file.read_text().strip() == _pom_digest()


def _download_into(libs: Path) -> None:
    """Fetch into a private sibling and rename it, so a half-finished fetch is never used."""
    staging = libs.with_name(f"{libs.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    command = maven_command(staging)
    try:
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            output = (result.stdout + result.stderr).strip()[-4000:]
            raise JarFetchError(
                f"`{' '.join(command)}` failed with exit code {result.returncode}:\n{output}"
            )
        (staging / _POM_DIGEST_FILE).write_text(_pom_digest())
        _replace_dir(staging, libs)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _replace_dir(new: Path, target: Path) -> None:
    """Move ``new`` into place; a concurrent fetch that got there first with this pom wins."""
    if _filled_by_current_pom(target):
        return
    shutil.rmtree(target, ignore_errors=True)
    try:
        new.rename(target)
    except OSError:
        if not _filled_by_current_pom(target):
            raise
