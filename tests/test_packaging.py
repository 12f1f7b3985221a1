"""The wheel built from a clean checkout carries every module and every data file of the package tree.

The editable install resolves imports from the working tree, so it cannot show a subpackage or a data
file that the wheel would silently lack: this builds the wheel from the tracked files alone.
"""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True)
    return [name for name in out.stdout.decode().split("\0") if name and (REPO / name).is_file()]


def test_wheel_from_clean_checkout_has_the_whole_package(tmp_path):
    if shutil.which("git") is None or not (REPO / ".git").exists():
        raise AssertionError("the packaging test needs the git checkout it was run from")
    checkout = tmp_path / "checkout"
    tracked = _tracked_files()
    for name in tracked:
        (checkout / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, checkout / name)
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(checkout)],
        check=True,
        capture_output=True,
    )
    (wheel,) = wheels.glob("dflash_agent-*.whl")
    in_wheel = set(zipfile.ZipFile(wheel).namelist())
    package_files = {name for name in tracked if name.startswith("dflash_agent/") and "__pycache__" not in name}
    missing = sorted(package_files - in_wheel)
    assert not missing, f"the wheel lacks {missing}"
    # Nothing outside the one import package is installed as a top-level name.
    top_level = {name.split("/")[0] for name in in_wheel if not name.startswith("dflash_agent-")}
    assert top_level == {"dflash_agent"}
