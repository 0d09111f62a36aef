#!/usr/bin/env bash
# The trainers' venv for the DFlash-family checks (tools/specforge_offline_check.py,
# tools/modelopt_offline_check.py): SpecForge and ModelOpt at a current commit (a source tree,
# e.g. `git archive` of sgl-project/SpecForge and NVIDIA/Model-Optimizer), installed with
# --no-deps; every other package (torch, transformers, pydantic, ...) is the project venv's,
# seen through a .pth file, plus the two ModelOpt's import chain needs (PuLP, scipy).
#   SPECFORGE_SRC=DIR MODELOPT_SRC=DIR [VENV=/tmp/drafters-venv] bash tools/drafters_venv.sh
#   KIMI_PIPE_SPECFORGE_PYTHON=$VENV/bin/python .venv/bin/python -m pytest tests/test_export_dflash.py
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
VENV=${VENV:-/tmp/drafters-venv}
: "${SPECFORGE_SRC:?a SpecForge source tree}"
BASE=$("$PY" -c "import sys; print(sys.base_prefix)")/bin/python3
SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
"$BASE" -m venv "$VENV"
OWN=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$SITE" > "$OWN/zz_project_venv.pth"
"$VENV/bin/pip" install -q --no-deps "$SPECFORGE_SRC"
if [ -n "${MODELOPT_SRC:-}" ]; then
  SETUPTOOLS_SCM_PRETEND_VERSION=${MODELOPT_VERSION:-0.0.0} \
    "$VENV/bin/pip" install -q --no-deps "$MODELOPT_SRC"
  "$VENV/bin/pip" install -q PuLP==3.3.2 scipy==1.17.1
fi
"$VENV/bin/python" -c "from specforge.algorithms.builtin import builtin_algorithm_registry as r; print('specforge strategies:', r().names)"
