#!/usr/bin/env bash
# `make sglang-cpu`: SGLang's real engine on this CPU (Intel Xeon with AVX-512 + AMX), in its
# own venv (SGLang pins its own torch and transformers), for `extract=sglang extract.device=cpu`
# and the `sglang_cpu` test tier (`make test-sglang-cpu`). docs/sglang.md, "SGLang on CPU".
#
# PyPI has no CPU build of SGLang's kernel package, so it is compiled from SGLang's sources at
# a pinned commit (about 6 min on 2 cores) and the wheel is cached under
#   ${XDG_CACHE_HOME:-~/.cache}/kimi_pipe/sglang-kernel-cpu/<key>/
# with <key> = hash of the kernel source trees, the torch version, the Python tag and the flags:
# a second setup (another clone, a rebuilt venv) reuses it.
#
# Settings (environment):
#   SGLANG_SRC   SGLang's kernel sources, only needed when the kernel wheel is not cached yet:
#                a git clone of sgl-project/sglang (or a fork, bare works) holding KERNEL_COMMIT,
#                or a directory / .tar.gz holding python/sglang/kernels/aot/{csrc/cpu,include,
#                python/sgl_kernel} with the pinned contents (KERNEL_CONTENT), e.g. made once by
#                  git -C CLONE archive --format=tar.gz -o sglang-kernel-cpu-src-7f8f0300.tar.gz \
#                    7f8f0300 python/sglang/kernels/aot/{csrc/cpu,include,python/sgl_kernel}
#                Default: ../shared/sglang/sglang-kernel-cpu-src-7f8f0300.tar.gz when it exists.
#   SGLANG_VENV  the venv to make (default .venv-sglang)
#   PY           Python 3.11 (the sglang wheel is cp311 only; default: python3.11)
#   MAX_JOBS     parallel compiler jobs (default: the number of cores)
# Exit 2 with one `error: ...` line when the host cannot do it (no AMX, no compiler, ...).
set -euo pipefail
cd "$(dirname "$0")/../.."

SGLANG_VERSION=0.5.14           # = kimi_pipe/extraction/sglang/settings.py SGLANG_VERSION
TORCH_VERSION=2.11.0            # what sglang 0.5.14 pins; the kernel is built against it
# Kernel sources: SGLang's python/sglang/kernels/aot/{csrc/cpu,include,python/sgl_kernel} at
# this commit (sgl-project/sglang main of 2026-08-20, as mirrored by the ZailiWang/sglang fork),
# checked by git tree hash so any clone that has the same trees is accepted.
KERNEL_COMMIT=7f8f030000b628ea2cb033e7457a13dd0ac80f99
KERNEL_TREES="csrc/cpu=201f4b22565bf5f051c6f18dbf7e2fc5c1707e50 include=148800b41f3af611ca28d299cc69d269e0725474 python/sgl_kernel=183cd4659875c8f36e4ef5fb911d77820ea3440a"
# The same sources as file contents: sha256 of `sha256sum` over their sorted paths (any copy).
KERNEL_CONTENT=def606f2b0f93ffa21c29b171b9adf84cd62255af01cd28758dab65123f11dbb
KERNEL_VERSION=0.4.6.post1+kp.${KERNEL_COMMIT:0:8}  # the fork's pyproject_cpu.toml version
SHARED_SRC=../shared/sglang/sglang-kernel-cpu-src-${KERNEL_COMMIT:0:8}.tar.gz
AOT=python/sglang/kernels/aot
VENV=${SGLANG_VENV:-.venv-sglang}
PY=${PY:-python3.11}
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/kimi_pipe/sglang-kernel-cpu
REQS=tools/sglang_cpu/requirements.txt

die() { echo "error: $*" >&2; exit 2; }
T0=$(date +%s)
say() { printf '[sglang-cpu %4ss] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }

# --- can this host run it? -------------------------------------------------------------------
[ "$(uname -m)" = x86_64 ] || die "SGLang's CPU engine is built here for x86_64 with AMX; this host is $(uname -m)"
flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
has() { for f in "$@"; do [[ "$flags" == *" $f "* ]] || return 1; done; }
# Which of SGLang's CPU builds this host runs (tools/sglang_cpu/kernel_setup.py):
if has avx512f avx512_bf16 avx512_vnni amx_tile amx_bf16; then
    ISA=${SGL_KERNEL_ISA:-amx}      # SGLang's x86 build: its AMX kernels and intel_amx attention
elif has avx2 fma; then
    ISA=${SGL_KERNEL_ISA:-avx2}     # no AVX-512/AMX: SGLang's own non-AMX build, torch-native paths
    echo "note: this CPU has no AMX ($(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2 | xargs)): building SGLang's non-AMX kernel; SGLang then runs its torch-native layers and attention (extract.server_args={attention_backend: torch_native})" >&2
else
    die "this CPU has neither AMX (Intel Xeon 4th gen or later) nor AVX2+FMA; SGLang's CPU engine needs one of them"
fi
# (SGL_KERNEL_* reach only the kernel build: SGLang itself reads every SGL_* variable as SGLANG_*.)
# -O3 as SGLang builds it; the avx2 build defaults to -O1: SGLang calls few of its kernels on a
# CPU without AMX, and it compiles several times faster (37 min here on 2 loaded cores).
if [ "$ISA" = avx2 ]; then OPT=${SGL_KERNEL_OPT:--O1}; else OPT=${SGL_KERNEL_OPT:--O3}; fi
command -v "$PY" >/dev/null 2>&1 && "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null \
    || die "Python 3.11 not found as $PY (sglang $SGLANG_VERSION ships cp311 wheels only); set PY=/path/to/python3.11"

# --- the venv and torch ------------------------------------------------------------------------
if [ -x "$VENV/bin/python" ] && ! "$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
    say "$VENV is not Python 3.11: making it again"; rm -rf "$VENV"
fi
[ -x "$VENV/bin/python" ] || { say "venv $VENV"; "$PY" -m venv "$VENV"; }
VPY=$VENV/bin/python
PIP=("$VPY" -m pip install --quiet --disable-pip-version-check)
say "torch $TORCH_VERSION and what sglang's CPU engine imports ($REQS)"
"${PIP[@]}" -r "$REQS"
TORCH_SEEN=$("$VPY" -c "import torch; print(torch.__version__.split(\"+\")[0])")
[ "$TORCH_SEEN" = "$TORCH_VERSION" ] || die "$VENV has torch $TORCH_SEEN, expected $TORCH_VERSION"

# --- the kernel wheel: cached, else built ---------------------------------------------------------
PYTAG=$("$VPY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
KEY=$(printf '%s\n' "$KERNEL_TREES" "torch=$TORCH_VERSION" "$PYTAG" "isa=$ISA" "opt=$OPT" "$(sha256sum tools/sglang_cpu/kernel_setup.py | cut -c1-64)" | sha256sum | cut -c1-16)
WHEEL_DIR=$CACHE/$KEY
WHEEL=$(ls "$WHEEL_DIR"/sglang_kernel_cpu-*.whl 2>/dev/null | head -n1 || true)
if [ -z "$WHEEL" ]; then
    say "kernel wheel not cached ($WHEEL_DIR): building it from SGLang's sources at ${KERNEL_COMMIT:0:12}"
    command -v g++ >/dev/null 2>&1 || die "no C++ compiler: install g++ 12 or later (apt-get install g++)"
    gxx=$(g++ -dumpversion | cut -d. -f1)
    [ "$gxx" -ge 12 ] || die "g++ $gxx is too old for -mamx-* and C++20: install g++ 12 or later"
    # g++ prints a full path only for a library its linker finds.
    { [ -f /usr/include/numa.h ] && [ "$(g++ -print-file-name=libnuma.so)" != libnuma.so ]; } \
        || die "libnuma headers not found: install them (apt-get install libnuma-dev)"
    SRC=${SGLANG_SRC:-}
    [ -n "$SRC" ] || { [ -f "$SHARED_SRC" ] && SRC=$SHARED_SRC; } \
        || die "the kernel needs SGLang's sources: set SGLANG_SRC to a git clone of sgl-project/sglang holding commit $KERNEL_COMMIT (a bare clone works) or to an archive of its kernel sources (see the top of $0), or put that archive at $SHARED_SRC"
    [ -e "$SRC" ] || die "SGLANG_SRC=$SRC does not exist"
    BUILD=$(mktemp -d "${TMPDIR:-/tmp}/sgl-kernel-cpu.XXXXXX")
    trap 'rm -rf "$BUILD"' EXIT
    if git -C "$SRC" rev-parse --git-dir >/dev/null 2>&1; then
        git -C "$SRC" cat-file -e "$KERNEL_COMMIT^{commit}" 2>/dev/null \
            || die "SGLANG_SRC=$SRC has no commit $KERNEL_COMMIT: fetch it (git -C $SRC fetch origin $KERNEL_COMMIT)"
        for pair in $KERNEL_TREES; do
            want=${pair#*=}; got=$(git -C "$SRC" rev-parse "$KERNEL_COMMIT:$AOT/${pair%%=*}")
            [ "$got" = "$want" ] || die "$AOT/${pair%%=*} at $KERNEL_COMMIT is tree $got, pinned $want"
        done
        git -C "$SRC" archive "$KERNEL_COMMIT" "$AOT/csrc/cpu" "$AOT/include" "$AOT/python/sgl_kernel" \
            | tar -x -C "$BUILD" --strip-components=4
    else
        # A directory or an archive: find the aot folder in it (at its top or one level down).
        if [ -f "$SRC" ]; then
            mkdir "$BUILD/src" && tar -xf "$SRC" -C "$BUILD/src" || die "SGLANG_SRC=$SRC is not a tar archive"
            TOP=$BUILD/src
        else
            TOP=$SRC
        fi
        FOUND=$(ls -d "$TOP/$AOT" "$TOP"/*/"$AOT" 2>/dev/null | head -n1 || true)
        [ -n "$FOUND" ] || die "SGLANG_SRC=$SRC holds no $AOT"
        for sub in csrc/cpu include python/sgl_kernel; do
            mkdir -p "$BUILD/$(dirname "$sub")" && cp -r "$FOUND/$sub" "$BUILD/$sub"
        done
    fi
    got=$(cd "$BUILD" && find csrc/cpu include python/sgl_kernel -type f | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-64)
    [ "$got" = "$KERNEL_CONTENT" ] || die "SGLANG_SRC=$SRC: the kernel sources differ from the pinned ones (content $got, pinned $KERNEL_CONTENT; commit $KERNEL_COMMIT)"
    rm -rf "$BUILD/src"
    cp tools/sglang_cpu/kernel_setup.py "$BUILD/setup.py"
    say "compiling $(find "$BUILD/csrc/cpu" -name '*.cpp' -not -path '*/aarch64/*' | wc -l) files with ${MAX_JOBS:-$(nproc)} jobs (log: $BUILD/build.log)"
    if ! (cd "$BUILD" && MAX_JOBS=${MAX_JOBS:-$(nproc)} SGL_KERNEL_VERSION=$KERNEL_VERSION SGL_KERNEL_ISA=$ISA SGL_KERNEL_OPT=$OPT \
            "$OLDPWD/$VPY" -m pip wheel --no-deps --no-build-isolation -w dist . >build.log 2>&1); then
        tail -n 30 "$BUILD/build.log" >&2
        die "the kernel build failed (last lines above)"
    fi
    mkdir -p "$WHEEL_DIR"
    cp "$BUILD"/dist/sglang_kernel_cpu-*.whl "$WHEEL_DIR/"
    printf 'commit %s\n%s\ntorch %s\n%s\nisa %s\nopt %s\n' "$KERNEL_COMMIT" "$KERNEL_TREES" "$TORCH_VERSION" "$PYTAG" "$ISA" "$OPT" > "$WHEEL_DIR/SOURCE"
    WHEEL=$(ls "$WHEEL_DIR"/sglang_kernel_cpu-*.whl | head -n1)
    say "kernel wheel cached: $WHEEL"
else
    say "kernel wheel from the cache: $WHEEL"
fi

# --- sglang, its imports, and this project ---------------------------------------------------------
"${PIP[@]}" --no-deps --force-reinstall "$WHEEL"
say "sglang $SGLANG_VERSION (--no-deps: its CUDA-only pins do not install on CPU) and this project"
"${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION"
"${PIP[@]}" --no-deps --no-build-isolation -e .

# --- proof it works: the kernel loads, sglang's CPU engine module imports, AMX where built --------
BUILT_ISA=$ISA SGLANG_USE_CPU_ENGINE=1 "$VPY" - <<'EOF'
import os

import sgl_kernel, torch
import sglang
from sglang.srt.utils import cpu_has_amx_support, is_cpu
import kimi_pipe.extraction.sglang.settings as b

assert is_cpu(), "sglang did not select its CPU engine"
assert sglang.__version__ == b.SGLANG_VERSION, (sglang.__version__, b.SGLANG_VERSION)
amx = cpu_has_amx_support()
if os.environ["BUILT_ISA"] == "amx":
    assert amx, "sglang sees no AMX on this CPU"
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    y = torch.ops.sgl_kernel.rmsnorm_cpu(x, torch.ones(64, dtype=torch.bfloat16), 1e-6)
    ref = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.allclose(y.float(), ref, atol=3e-2), "AMX rmsnorm_cpu disagrees with the formula"
print(f"sglang {sglang.__version__}, torch {torch.__version__}, sgl_kernel {sgl_kernel.__file__}, "
      f"AMX {'yes' if amx else 'no (torch-native paths)'}")
EOF
say "done: $VENV ($(du -sh "$VENV" | cut -f1)); kernel cache $(du -sh "$CACHE" | cut -f1)"
