#!/usr/bin/env bash
# torchft's own environment for the torchft DiLoCo peer: never a dependency of phalanx.
# Creates benchmarks/torchft/.venv-torchft on top of phalanx's venv (--system-site-packages, so phalanx itself is
# importable there) and installs torchft 0.2.0 under the project's constraints, which pin torch to the same version
# (pip may still place its own copy of that torch wheel in this venv; it never touches phalanx's venv).
# Then the quality benchmark runs torchft's DiLoCo and Streaming DiLoCo as peers (benchmarks/quality/torchft_peer.py):
#   PY=benchmarks/torchft/.venv-torchft/bin/python benchmarks/quality.sh OUT
set -euo pipefail
cd "$(dirname "$0")"
PY=${PY:-../../.venv/bin/python}
$PY -m venv --system-site-packages .venv-torchft
# --system-site-packages reaches the base interpreter's packages, not those of phalanx's venv: a .pth line adds
# phalanx's venv after this one's own (the report's plots need its matplotlib; torchft's pins stay first).
# site.addsitedir, not a bare path: the venv's own .pth files must run too, and phalanx's editable install is one.
SITE=$(.venv-torchft/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
$PY -c "import sysconfig; print('import site; site.addsitedir(%r)' % sysconfig.get_paths()['purelib'])" \
  > "$SITE/phalanx-venv.pth"
.venv-torchft/bin/pip install -c ../../constraints.txt torchft==0.2.0
.venv-torchft/bin/python -c "import phalanx, torchft, torch; print('torchft', torchft.__version__ if hasattr(torchft, '__version__') else '0.2.0', 'torch', torch.__version__)"
