#!/bin/bash
# Stage what the GPU scripts install, for a GPU machine without network (it has a CUDA torch).
# Run on a machine with network, from the repository root; copy the checkout with the folders
# it writes to the GPU machine, where benchmarks/gpu_env.sh finds .gpu-carry/ and installs
# from the folders with no index:
#   .whl/        wheels of passkit, passkit-fusion and passkit-testing, and of their
#                dependencies but torch and numpy (the GPU machine's own)
#   .gpu-carry/  flashinfer (slimmed: the kernel sources the all-reduce fusion does not build
#                are left out, which keeps the folder small enough to copy around), the
#                wheels it imports, activate.sh (installs them, sets flashinfer's cache folder
#                and multicast off) and save-jit.sh (copies the kernels built at first use to
#                $OUT, so they can travel as prebuilt ones next time)
#   .whl-hf/     with STAGE_HF=1: transformers and accelerate for the Hugging Face scripts
# The folders are git-ignored. Options (environment variables):
#   FLASHINFER_VERSION   flashinfer-python release (default 0.7.2.post1, what the results used)
#   FLASHINFER_DEPS      the wheels flashinfer imports that the GPU machine lacks
#   TARGET_PYTHON        the GPU machine's Python, as pip's --python-version (default: this one's)
#   STAGE_AOT=DIR        prebuilt kernel libraries (NAME.so, saved by save-jit.sh on a machine of
#                        the same GPU architecture) to install as flashinfer AOT modules
#   STAGE_SLIM=0         the whole flashinfer wheel, not slimmed
#   STAGE_HF=1           also .whl-hf/ (HF_PACKAGES with their dependencies, HF_NO_DEPS alone:
#                        the releases the suite tests; torch and numpy are left out)
# Usage: bash benchmarks/stage_offline.sh [--help]
set -euo pipefail
if [ "${1:-}" = --help ] || [ "${1:-}" = -h ]; then awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0; fi
[ -f pyproject.toml ] && [ -d passkit_fusion ] || { echo "run from the repository root" >&2; exit 2; }
VERSION=${FLASHINFER_VERSION:-0.7.2.post1}
DEPS=${FLASHINFER_DEPS:-"apache-tvm-ffi<0.2,>=0.1.11 cuda-tile>=1.4.0 nccl4py>=0.4.1"}
PY=${TARGET_PYTHON:-$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}
HF_PACKAGES=${HF_PACKAGES:-"transformers==5.23.0 psutil pyyaml"}  # with their dependencies
HF_NO_DEPS=${HF_NO_DEPS:-"accelerate==1.15.0"}  # alone: its own requirements name torch
# binary wheels for the GPU machine's platform, whatever this machine is
TARGET=(--only-binary=:all: --implementation cp --python-version "$PY"
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
pip() { python3 -m pip "$@"; }

echo "== .whl/: the three distributions and their dependencies (torch and numpy aside)"
rm -rf .whl && mkdir -p .whl
pip wheel -q --no-deps -w .whl . ./passkit_fusion ./passkit_testing
# the dependencies of the three, read from their metadata, minus what the GPU machine has
mapfile -t REQS < <(python3 - .whl/*.whl <<'PY'
import re, sys, zipfile
skip = {"torch", "numpy", "passkit", "passkit-fusion", "passkit-testing"}
for wheel in sys.argv[1:]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        for line in z.read(meta).decode().splitlines():
            if line.startswith("Requires-Dist:") and "extra ==" not in line:
                req = line.split(":", 1)[1].split(";")[0].strip()
                if re.split(r"[ <>=!~\[]", req, maxsplit=1)[0].lower() not in skip:
                    print(req)
PY
)
[ "${#REQS[@]}" = 0 ] || pip download -q "${TARGET[@]}" -d .whl "${REQS[@]}" pytest pytest-xdist

echo "== .gpu-carry/: flashinfer-python $VERSION"
rm -rf .gpu-carry && mkdir -p .gpu-carry/aot
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
pip download -q --no-deps -d "$WORK" "flashinfer-python==$VERSION"
# shellcheck disable=SC2086
pip download -q --no-deps "${TARGET[@]}" -d .gpu-carry $DEPS
python3 - "$WORK"/flashinfer_python-*.whl .gpu-carry/flashinfer.tar.gz "${STAGE_SLIM:-1}" <<'PY'
"""The wheel's files as a tarball to unpack onto a path entry; slimmed, it leaves out the
kernel sources no all-reduce fusion module builds from (CUTLASS, the experimental and MoE
kernels, the nested csrc folders except nv_internal), keeping every Python file."""
import io, sys, tarfile, zipfile

wheel, out, slim = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
UNUSED = ("flashinfer/data/cutlass", "flashinfer/experimental/", "flashinfer/moe_ep/kernel_src")


def wanted(name: str) -> bool:
    if not slim or name.endswith(".py"):
        return True
    if name.startswith(UNUSED):
        return False
    parts = name.split("/")
    return not (name.startswith("flashinfer/data/csrc/") and len(parts) > 4 and parts[3] != "nv_internal")


kept = 0
with zipfile.ZipFile(wheel) as z, tarfile.open(out, "w:gz") as tar:
    for info in z.infolist():
        if info.is_dir() or not wanted(info.filename):
            continue
        data = z.read(info)
        entry = tarfile.TarInfo(info.filename)
        entry.size, entry.mode = len(data), 0o644
        tar.addfile(entry, io.BytesIO(data))
        kept += 1
print(f"flashinfer: {kept} files{' (slimmed)' if slim else ''}")
PY
if [ -n "${STAGE_AOT:-}" ]; then cp "$STAGE_AOT"/*.so .gpu-carry/aot/; fi

cat > .gpu-carry/activate.sh <<'SH'
# Sourced by benchmarks/gpu_env.sh on the GPU machine: flashinfer and its wheels into
# /tmp/flashinfer-site (once per machine), prebuilt kernels as AOT modules, multicast off.
_carry=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
_site=/tmp/flashinfer-site
if [ ! -f "$_site/.staged" ]; then
  mkdir -p "$_site" /tmp/flashinfer-cache
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$_site" "$_carry"/*.whl || return 1
  tar xzf "$_carry/flashinfer.tar.gz" -C "$_site" || return 1
  for _lib in "$_carry"/aot/*.so; do
    [ -f "$_lib" ] || continue
    _name=$(basename "$_lib" .so)
    mkdir -p "$_site/flashinfer/data/aot/$_name" && cp "$_lib" "$_site/flashinfer/data/aot/$_name/"
  done
  touch "$_site/.staged"
fi
export PYTHONPATH=$_site${PYTHONPATH:+:$PYTHONPATH}
export FLASHINFER_WORKSPACE_BASE=/tmp/flashinfer-cache
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SH
cat > .gpu-carry/save-jit.sh <<'SH'
# On the GPU machine, at the end of a command: the kernels flashinfer built at first use, to
# $OUT (stage them again with STAGE_AOT=DIR to skip that build on the next machine).
find /tmp/flashinfer-cache -path '*cached_ops/*' -name '*.so' -exec cp {} "$OUT/" \; 2>/dev/null
ls "$OUT"/*.so 2>/dev/null || echo "no kernels built at first use"
SH

if [ "${STAGE_HF:-0}" = 1 ]; then
  echo "== .whl-hf/: $HF_PACKAGES"
  rm -rf .whl-hf && mkdir -p .whl-hf
  # shellcheck disable=SC2086
  pip download -q "${TARGET[@]}" -d .whl-hf $HF_PACKAGES
  # shellcheck disable=SC2086
  pip download -q --no-deps "${TARGET[@]}" -d .whl-hf $HF_NO_DEPS
  rm -f .whl-hf/torch-*.whl .whl-hf/numpy-*.whl .whl-hf/nvidia_*.whl .whl-hf/triton-*.whl
fi
du -sh .whl .gpu-carry ${STAGE_HF:+.whl-hf} 2>/dev/null || true
