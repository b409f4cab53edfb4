"""Writing Parquet loads no more of pyarrow than the writer needs: ``pyarrow.compute`` (0.1-0.2
s of CPU to import) is only for reading, so an export, and every worker of an export in parts,
goes without it."""

from __future__ import annotations

import subprocess
import sys

from tests.paths import REPO_ROOT


def test_a_parquet_export_does_not_import_pyarrow_compute(tmp_path):
    code = (
        "import sys\n"
        "import embstore\n"
        "from embstore.transfer import export_file\n"
        f"with embstore.open('lmdb://{tmp_path}/s', dim=4) as s:\n"
        "    s.assign([1, 2, 3], [[0.5] * 4] * 3)\n"
        f"    assert export_file(s, '{tmp_path}/out.parquet') == 3\n"
        "print('pyarrow.compute' in sys.modules)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, cwd=REPO_ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
